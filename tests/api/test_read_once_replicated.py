"""Read once, exchange over the process group: an item several ranks need is read from storage by
one rank and sent to the others; `LoadResult` says what each rank read and received.

Plain replicated state here (every rank saves and loads the same tensors and objects); the
parallel layouts (DDP, HSDP, FSDP2+TP) on local disk and S3 are in tests/elastic/test_read_once_layouts.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib

MIB = 1 << 20


def _state(fill: float) -> dict:
    return {
        "model": {f"w{i}": torch.full((256 + i, 1024), fill + i) for i in range(8)},
        "extra": {"names": ["a", "b"], "lr": 0.5 + fill},
        "step": 7,
    }


def _load_and_report(path: str, options: dict) -> dict:
    state = _state(-1.0)
    result = ckptlib.load(path, state, **options)
    expected = _state(0.0)
    return {
        "exact": all(torch.equal(state["model"][k], v) for k, v in expected["model"].items())
        and state["extra"] == expected["extra"]
        and state["step"] == 7,
        "rank": dist.get_rank(),
        "read": result.storage_bytes_read,
        "by_rank": result.storage_bytes_read_by_rank,
        "by_source": result.bytes_by_source,
        "received": result.bytes_received,
        "needed": result.bytes_needed,
        "read_once": result.read_once,
    }


def test_replicated_state_is_read_once(tmp_path, dist_run):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    once = dist_run(4, _load_and_report, path, {"read_once": True}, timeout=120)
    every = dist_run(4, _load_and_report, path, {"read_once": False}, timeout=120)
    needed = once[0]["needed"]
    assert needed > 8 * 256 * 1024 * 4
    assert [r["read_once"] for r in once] == [True] * 4 and [r["read_once"] for r in every] == [False] * 4
    for results in (once, every):
        assert all(r["exact"] for r in results)
        assert [r["by_rank"] for r in results] == [[r["read"] for r in results]] * 4  # every rank has the list
        assert all(r["needed"] == needed for r in results)
        assert all(r["by_source"] == {"local": sum(r["by_rank"])} for r in results)
    assert needed <= sum(once[0]["by_rank"]) <= 1.1 * needed
    assert sorted(r["read"] > 0 for r in once) == [True] * 4  # the reads are spread over the ranks
    for r in once:  # each rank receives what the others read
        assert r["received"] == sum(once[0]["by_rank"]) - r["read"]
    # the negative control: every rank reads everything itself
    assert sum(every[0]["by_rank"]) >= 3.9 * needed and all(r["received"] == 0 for r in every)
    # `ckpt plan`'s prediction, from the ranks' plans made in one process, is what they read
    predicted = _predicted(path, 4)
    assert predicted.storage_bytes() == once[0]["by_rank"] and predicted.bytes_needed == needed


def _predicted(path: str, world: int):
    from ckptlib.format import SafeLoadPlanner
    from ckptlib.format.read.read_schedule import predict_reads
    from ckptlib.format.source import inspect_checkpoint

    metadata = inspect_checkpoint(path).metadata
    plans = []
    for rank in range(world):
        planner = SafeLoadPlanner()
        planner.set_up_planner(_state(-1.0), metadata, rank == 0)
        plans.append(planner.create_local_plan())
    return predict_reads(plans, metadata)


def test_a_single_process_load_reports_its_reads(tmp_path):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    state = _state(-1.0)
    result = ckptlib.load(path, state)
    assert torch.equal(state["model"]["w5"], _state(0.0)["model"]["w5"])
    assert result.storage_bytes_read == result.bytes_needed == sum(result.storage_bytes_read_by_rank)
    assert result.bytes_by_source == {"local": result.bytes_needed} and result.bytes_received == 0


def _load_with(path: str, case: str) -> dict:
    """Load the replicated state at 4 ranks with one option (`case`); what came back."""
    state, options = _state(-1.0), {"read_once": True}
    if case == "verify_off":
        options["verify"] = False
    elif case == "cast":
        state["model"] = {k: v.to(torch.float64) for k, v in state["model"].items()}
        options["cast"] = True
    elif case == "only":
        options["only"] = ("model",)
    result = ckptlib.load(path, state, **options)
    expected = _state(0.0)
    exact = all(torch.equal(state["model"][k], v.to(state["model"][k].dtype)) for k, v in expected["model"].items())
    if case == "only":  # the rest stays as it was
        exact = exact and state["extra"] == _state(-1.0)["extra"] and state["step"] == 7
    else:
        exact = exact and state["extra"] == expected["extra"]
    return {
        "exact": exact,
        "dtype": str(state["model"]["w0"].dtype),
        "sum": sum(result.storage_bytes_read_by_rank),
        "needed": result.bytes_needed,
        "received": result.bytes_received,
    }


@pytest.mark.parametrize("case", ["verify_off", "cast", "only"])
def test_read_once_with_load_options(tmp_path, dist_run, case):
    """verify=False, cast=True (float32 saved, float64 asked: the receivers convert) and only=
    (the items of the other entries are neither read nor sent): exact, and read once."""
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    results = dist_run(4, _load_with, path, case, timeout=120)
    assert all(r["exact"] for r in results), results
    if case == "cast":
        assert {r["dtype"] for r in results} == {"torch.float64"}
    needed = results[0]["needed"]
    assert needed <= results[0]["sum"] <= 1.1 * needed and all(r["received"] > 0 for r in results)
    if case == "only":  # just the model's tensors
        assert needed < sum(256 + i for i in range(8)) * 1024 * 4 * 1.05


def _sampler_loader(world: int | None = None, rank: int | None = None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptlib.state.sampler import ElasticDistributedSampler

    sampler = ElasticDistributedSampler(53, world, rank, shuffle=True, seed=11)
    sampler.set_epoch(1)
    return StatefulDataLoader(list(range(53)), batch_size=3, sampler=sampler)


def _save_progress(path: str) -> list[int]:
    from ckptlib.state.sampler import MergeSamplerProgress

    loader, seen = _sampler_loader(), []
    for i, batch in enumerate(loader):
        seen += batch.tolist()
        if i == dist.get_rank() + 1:  # unequal progress per rank
            break
    ckptlib.save(path, {"data": ckptlib.RankLocal(loader, policy=MergeSamplerProgress())})
    return seen


def _resume_progress(path: str) -> dict:
    from ckptlib.state.sampler import MergeSamplerProgress

    loader = _sampler_loader()
    result = ckptlib.load(path, {"data": ckptlib.RankLocal(loader, policy=MergeSamplerProgress())}, read_once=True)
    seen = [i for batch in loader for i in batch.tolist()]
    return {"seen": seen, "received": result.bytes_received, "sum": sum(result.storage_bytes_read_by_rank)}


def test_resize_with_merged_sampler_progress_reads_each_saved_rank_once(tmp_path, dist_run):
    """Saved at 3 ranks, resumed at 2: every rank needs every saved rank's entry; each is read
    from storage once and sent to the other rank; the epoch is still seen exactly once."""
    path = str(tmp_path / "c")
    before = dist_run(3, _save_progress, path, timeout=120)
    after = dist_run(2, _resume_progress, path, timeout=120)
    seen = [i for part in before for i in part] + [i for r in after for i in r["seen"]]
    assert sorted(seen) == list(range(53))
    assert all(r["received"] > 0 for r in after)
    needed = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".distcp"))
    assert after[0]["sum"] <= needed  # each saved entry once (not once per new rank)


def _load_on_subgroup(path: str) -> dict | None:
    """Ranks 1..3 of 4 load on a subgroup (their group ranks are 0..2): the exchange maps them."""
    group = dist.new_group(ranks=[1, 2, 3])
    if dist.get_rank() == 0:
        return None
    state = _state(-1.0)
    result = ckptlib.load(path, state, process_group=group, read_once=True)
    expected = _state(0.0)
    return {
        "exact": all(torch.equal(state["model"][k], v) for k, v in expected["model"].items()),
        "sum": sum(result.storage_bytes_read_by_rank),
        "ranks": len(result.storage_bytes_read_by_rank),
        "needed": result.bytes_needed,
        "received": result.bytes_received,
    }


def test_read_once_on_a_subgroup(tmp_path, dist_run):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    results = dist_run(4, _load_on_subgroup, path, timeout=120)
    assert results[0] is None
    for r in results[1:]:
        assert r["exact"] and r["ranks"] == 3 and r["received"] > 0, r
        assert r["needed"] <= r["sum"] <= 1.1 * r["needed"]


def _load_expecting_failure(path: str) -> tuple:
    try:
        ckptlib.load(path, _state(-1.0), read_once=True)
    except ckptlib.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return ("ok",)


def test_a_damaged_shared_item_fails_every_rank_with_the_readers_error(tmp_path, dist_run):
    """One rank reads a damaged item for all: every rank raises its checksum error (not "the
    rank that reads it for me could not"), and nobody waits for a message that never comes."""
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        f.write(b"\xff\x00\xff\x00")
    outcomes = dist_run(4, _load_expecting_failure, path, timeout=120)
    assert len(set(outcomes)) == 1, outcomes
    kind, text = outcomes[0]
    assert kind == "CheckpointCorruptError" and "__0_0.distcp: checksum mismatch in tensor '" in text, text


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_plain_dcp_checkpoint_is_read_once_too(tmp_path, dist_run):
    """Written by torch's own dcp.save (no manifest, no checksums): still each item once."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "c")
    state = _state(0.0)
    dcp.save({"model": state["model"], "extra": state["extra"], "step": 7}, storage_writer=dcp.FileSystemWriter(path))
    results = dist_run(4, _load_and_report, path, {"read_once": True}, timeout=120)
    assert all(r["exact"] for r in results)
    needed = results[0]["needed"]
    assert needed <= sum(results[0]["by_rank"]) <= 1.1 * needed and all(r["received"] > 0 for r in results)
