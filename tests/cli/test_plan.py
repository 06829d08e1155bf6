"""`ckpt plan`: the dry run of a resharded load agrees with what real loads then read.

For several (N, save layout) -> (M, load layout) pairs of a model with large tensors (the
in-place, partial and checksum-block reads) and replicated state (read once and exchanged):
every rank's bytes read (LoadResult.storage_bytes_read_by_rank), bytes received, the load's
bytes needed, and the files, byte ranges and read calls measured at the file descriptor
(local disk), at `Storage.read` (a storage that hides its files: the object-store path) and
at the S3 client's GETs (moto). The plan reads only the manifest and `.metadata` and needs no
process group; errors exit 2.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import ckptlib
from ckptlib import cli
from ckptlib.offline.plan_load import PlanError, plan_load
from ckptlib.storage.local import LocalStorage
from ckptlib.testing.matrices import layout_matrix as lm

HIDDEN = 1104  # splits evenly over TP 2, 3, 4 (a row-wise layer's local input must)


class Wide(nn.Module):
    """Tensors of 0.5-4 MiB (read in place, rows at a time) and small ones (read whole)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(3001, 256)
        self.up = nn.Linear(256, HIDDEN)
        self.down = nn.Linear(HIDDEN, 256, bias=False)
        self.norm = nn.LayerNorm(256)
        self.register_buffer("table", torch.randn(700, 500))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(self.embed(tokens)))))

    def fsdp_units(self) -> list[nn.Module]:
        return [self.up, self.down]

    def tp_plan(self) -> dict:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
        }


def build(seed: int) -> Wide:
    torch.manual_seed(seed)
    return Wide()


def loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(torch.arange(12).reshape(3, 4) * 7 + step).square().mean()


SPEC = lm.ModelSpec(build=build, loss=loss)


def save(uri: str, layout: str) -> None:
    lm.save_layout(uri, layout, spec=SPEC, groups_2d=None)


class HiddenFiles(LocalStorage):
    """A local directory whose reads all go through `read` (as an object store's do), counted."""

    def __init__(self, root: str, reads: list, suffix: str = ".distcp"):
        super().__init__(root)
        self.reads, self.suffix = reads, suffix

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = super().read(path, offset, length)
        if path.endswith(self.suffix):
            self.reads.append((path, offset, len(data)))
        return data


def load_measured(uri: str, layout: str, how: str = "local", verify: bool = True, read_once="auto") -> dict:
    """Rank body: load `uri` into the model at `layout`; every shard-file read this rank made."""
    import ckptlib.format.read.dcp_reader as dcp_reader
    import ckptlib.format.read.direct_reads as direct_reads
    from ckptlib.storage import objects

    reads: list = []
    target = uri
    if how == "local":
        names: dict[int, str] = {}
        open_regular, pread = dcp_reader.open_regular, dcp_reader._pread_into

        def opening(path):
            fd, size = open_regular(path)
            names[fd] = os.path.basename(path)
            return fd, size

        def reading(fd, view, offset):
            got = pread(fd, view, offset)
            reads.append((names[fd], offset, view.nbytes))
            return got

        dcp_reader.open_regular = opening
        dcp_reader._pread_into = direct_reads._pread_into = reading
    elif how == "hidden":
        target = HiddenFiles(uri, reads)
    else:  # an object store: count its GETs of shard files
        get = objects.ObjectStorage._get

        def counting(self, key, where, start, end):
            if key.endswith(".distcp"):
                reads.append((key.rsplit("/", 1)[-1], start, end - start + 1))
            return get(self, key, where, start, end)

        objects.ObjectStorage._get = counting
    model, optim = lm.build(SPEC, layout, "adamw", seed=1)
    result = ckptlib.load(target, {"model": model, "optim": optim, "step": -1}, verify=verify, read_once=read_once)
    return {
        "reads": reads,
        "by_rank": result.storage_bytes_read_by_rank,
        "received": result.bytes_received,
        "needed": result.bytes_needed,
    }


def _ranges(reads) -> dict[str, list[list[int]]]:
    from ckptlib.format.items.ranged_io import _coalesce_ranges

    by_file: dict[str, list] = {}
    for name, offset, length in reads:
        by_file.setdefault(name, []).append((offset, offset + length))
    return {name: [list(r) for r in _coalesce_ranges(spans)] for name, spans in sorted(by_file.items())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(N, layout): a checkpoint of the model saved at that layout}, made on first use."""
    root = tmp_path_factory.mktemp("plan")
    made: dict = {}

    def get(n: int, layout: str) -> str:
        if (n, layout) not in made:
            uri = str(root / f"save{n}-{layout}")
            from ckptlib.testing import launch

            launch(n, save, uri, layout, timeout=240)
            made[(n, layout)] = uri
        return made[(n, layout)]

    return get


def _assert_agrees(plan, measured: list[dict], *, requests: bool = False) -> None:
    assert [r.bytes_read for r in plan.ranks] == measured[0]["by_rank"]
    assert [r.bytes_received for r in plan.ranks] == [m["received"] for m in measured]
    assert plan.bytes_needed == measured[0]["needed"]
    for rank, (planned, got) in enumerate(zip(plan.ranks, measured)):
        files = {f["file"]: f["ranges"] for f in planned.files}
        assert files == _ranges(got["reads"]), f"rank {rank}: byte ranges"
        if requests:
            assert planned.requests == len(got["reads"]), f"rank {rank}: GET requests"
        else:
            assert planned.reads == len(got["reads"]), f"rank {rank}: read calls"


CASES = [  # read once where it matters (forced: the default reads a local disk directly), and the default
    (2, "fsdp2", 3, "fsdp2", True, True),
    (2, "fsdp2", 3, "fsdp2", False, True),
    (3, "ddp", 4, "hsdp", True, True),
    (3, "ddp", 4, "hsdp", True, "auto"),
    (2, "fsdp2", 2, "ddp", True, True),
    (2, "fsdp2", 3, "tp", True, True),
    (4, "fsdp2+tp", 1, "plain", True, True),
]


@pytest.mark.parametrize(
    "n,save_layout,m,load_layout,verify,once",
    CASES,
    ids=[
        f"save{n}-{a}-load{m}-{b}{'' if v else '-noverify'}{'-default' if o == 'auto' else ''}"
        for n, a, m, b, v, o in CASES
    ],
)
def test_plan_matches_the_reads_of_a_real_load(saved, n, save_layout, m, load_layout, verify, once):
    from ckptlib.testing import launch

    uri = saved(n, save_layout)
    params, tp = None, None
    if load_layout in ("tp", "fsdp2+tp"):
        from ckptlib.cli.plan_cmd import spec_model_facts

        params, tp = spec_model_facts(f"{__file__}:SPEC", load_layout)
    plan = plan_load(uri, m, load_layout, params=params, tp_dims=tp, verify=verify, read_once=once)
    measured = launch(m, load_measured, uri, load_layout, "local", verify, once, timeout=240)
    _assert_agrees(plan, measured)
    assert plan.exact and plan.storage == "local" and plan.read_once == (m > 1 and once is True)


def test_plan_matches_reads_through_storage_read(saved):
    """The object-store path: partial reads in place, the rest in coalesced ranged reads."""
    from ckptlib.testing import launch

    uri = saved(2, "fsdp2")
    measured = launch(3, load_measured, uri, "fsdp2", "hidden", timeout=240)
    plan = plan_load(HiddenFiles(uri, []), 3, "fsdp2")
    assert plan.storage == "local" and plan.ranks[0].requests is None
    _assert_agrees(plan, measured)


def load_model_only(uri: str, layout: str) -> dict:
    """Rank body: load a model-only file (safetensors) into the model at `layout`, counted."""
    reads: list = []
    model, _ = lm.build(SPEC, layout, "adamw", seed=1)
    result = ckptlib.load(HiddenFiles(uri, reads, suffix=".safetensors"), {"model": model})
    with open(os.path.join(uri, "model.safetensors"), "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    tensors = [r for r in reads if r[1] >= data_start]  # (rank 0 also read the header, inspecting it)
    return {"reads": tensors, "by_rank": result.storage_bytes_read_by_rank, "received": 0, "needed": None}


def test_plan_of_a_safetensors_file_matches_its_reads(saved, tmp_path):
    """A foreign format: each rank reads its rows of each tensor with one ranged read. A
    model-only file does not say which tensors are buffers (whole on every rank under FSDP2):
    the spec's model does."""
    from ckptlib.cli.plan_cmd import spec_model_facts
    from ckptlib.testing import launch

    out = tmp_path / "hf"
    ckptlib.convert(saved(2, "fsdp2"), str(out / "model.safetensors"), to="safetensors")
    measured = launch(3, load_model_only, str(out), "fsdp2", timeout=240)
    params, _ = spec_model_facts(f"{__file__}:SPEC", "fsdp2")
    plan = plan_load(HiddenFiles(str(out), [], suffix=".safetensors"), 3, "fsdp2", params=params)
    assert plan.format == "safetensors" and not plan.read_once
    assert [r.bytes_read for r in plan.ranks] == measured[0]["by_rank"]
    for planned, got in zip(plan.ranks, measured):
        assert {f["file"]: f["ranges"] for f in planned.files} == _ranges(got["reads"])
        assert planned.reads == len(got["reads"])


@pytest.mark.s3
def test_plan_matches_s3_gets(s3_root, tmp_path):
    from ckptlib.testing import launch

    uri = f"{s3_root}/ckpt"
    launch(2, save, uri, "fsdp2", timeout=240)
    measured = launch(3, load_measured, uri, "ddp", "s3", timeout=240)
    plan = plan_load(uri, 3, "ddp")
    assert plan.storage == "s3" and plan.read_once
    _assert_agrees(plan, measured, requests=True)
    # Every replicated item is read by one rank (the coalesced ranged reads also take the gaps
    # of up to 1 MiB between a reader's items, which hold items other ranks read).
    assert plan.bytes_needed <= plan.bytes_read < plan.bytes_read_each_for_itself / 2


class Progress:
    """Per-rank state: a position and a 64 KiB history."""

    def __init__(self, rank: int):
        self.position, self.history = rank, torch.full((16384,), float(rank))

    def state_dict(self) -> dict:
        return {"position": self.position, "history": self.history}

    def load_state_dict(self, sd: dict) -> None:
        self.position, self.history = sd["position"], sd["history"]


class Merge:
    """A merging resize policy (as MergeSamplerProgress is): every rank reads every saved rank's state."""

    def source_rank(self, rank, saved_world_size, world_size):
        return None

    def merge(self, states, rank, world_size):
        return states[rank % len(states)]


def rank_state_round_trip(uri: str, merge: bool, save: bool) -> list[int]:
    """Rank body: save (or load) a model with per-rank state; the load's bytes by rank."""
    import torch.distributed as dist

    policy = Merge() if merge else None
    state = {"model": nn.Linear(64, 64), "progress": ckptlib.RankLocal(Progress(dist.get_rank()), policy=policy)}
    if save:
        ckptlib.save(uri, state)
        return []
    return ckptlib.load(uri, state, read_once=True).storage_bytes_read_by_rank


@pytest.mark.parametrize("merge", [False, True], ids=["keep", "merge"])
def test_per_rank_state_on_a_resize(tmp_path, merge):
    """Keep: a saved rank's entries go to that rank only; merge: every rank reads every saved
    rank's (here read once and exchanged)."""
    from ckptlib.testing import launch

    uri = str(tmp_path / "ckpt")
    launch(3, rank_state_round_trip, uri, merge, True, timeout=240)
    measured = launch(2, rank_state_round_trip, uri, merge, False, timeout=240)[0]
    plan = plan_load(uri, 2, "plain", rank_state="merge" if merge else "keep", read_once=True)
    assert [r.bytes_read for r in plan.ranks] == measured
    history = 16384 * 4
    if merge:
        assert sum(r.bytes_received for r in plan.ranks) >= 3 * history
    else:
        assert all(r.bytes_received < history for r in plan.ranks)


def test_cli_json_is_the_plan_and_reads_only_metadata(saved, capsys, monkeypatch):
    import torch.distributed as dist

    from ckptlib.storage import local

    uri = saved(2, "fsdp2")
    opened: list[str] = []
    original = local.open_regular

    def recording(path):
        opened.append(os.path.basename(path))
        return original(path)

    monkeypatch.setattr(local, "open_regular", recording)
    assert cli.main(["plan", uri, "--world-size", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert opened and set(opened) <= {"ckptlib.json", ".metadata"} and not dist.is_initialized()
    plan = plan_load(uri, 3, "fsdp2")
    assert doc == json.loads(json.dumps(plan.to_json()))
    assert doc["world_size"] == 3 and doc["saved_world_size"] == 2 and len(doc["ranks"]) == 3
    assert doc["bytes_read"] == sum(r["bytes_read"] for r in doc["ranks"]) and doc["bytes_needed"] > 0
    assert all(r["peak_host_bytes"] == r["state_bytes"] + r["transient_bytes"] for r in doc["ranks"])
    assert doc["bytes_read_each_for_itself"] >= doc["bytes_read"]


def test_state_bytes_are_each_ranks_part_of_the_state(saved):
    from ckptlib.testing import launch

    plan = plan_load(saved(2, "fsdp2"), 3, "fsdp2")
    assert [r.state_bytes for r in plan.ranks] == launch(3, local_state_bytes, "fsdp2", timeout=240)


def local_state_bytes(layout: str) -> int:
    """Rank body: the bytes of this rank's local tensors of the model and optimizer state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optim = lm.build(SPEC, layout, "adamw", seed=1)
    lm.train_step(SPEC, model, optim, 0)  # the optimizer's state exists after a step

    def local(value) -> int:
        value = value.to_local() if hasattr(value, "to_local") else value
        return value.numel() * value.element_size()

    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optim)["state"]
    return sum(local(v) for v in msd.values()) + sum(
        local(t) for states in osd.values() for t in states.values() if isinstance(t, torch.Tensor)
    )


def test_text_output_and_host_memory_limit(saved, capsys):
    uri = saved(2, "fsdp2")
    assert cli.main(["plan", uri, "-n", "4", "--layout", "hsdp", "--no-progress"]) == 0
    head = f"ckpt plan: {uri} (ckptlib, step 2, saved by 2 ranks) -> 4 ranks as hsdp, local storage, "
    assert (
        capsys.readouterr().out.splitlines()[0] == head + "each rank reads for itself"
    )  # the default, on a local disk
    assert cli.main(["plan", uri, "-n", "4", "--layout", "hsdp", "--ranges", "--read-once", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == head + "read once"
    assert out[1].split() == ["rank", "items", "read", "received", "sent", "files", "reads", "state", "peak", "host"]
    assert any(line.startswith("rank 3 __") for line in out) and out[-1].startswith("whole load: reads ")
    assert cli.main(["plan", uri, "-n", "4", "--host-memory", "1KiB"]) == 1
    assert "need more than --host-memory 1024 bytes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["-n", "3", "--layout", "hsdp"], "layout hsdp cannot run on 3 ranks"),
        (["-n", "2", "--layout", "tp"], "layout tp needs the model's TP plan"),
        (["-n", "2", "--spec", "no_such_module:SPEC"], "No module named 'no_such_module'"),
    ],
)
def test_errors_exit_2(saved, capsys, argv, message):
    assert cli.main(["plan", saved(2, "fsdp2"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt plan: error: ") and message in err


def test_missing_checkpoint_and_bad_world_size(tmp_path, capsys):
    assert cli.main(["plan", str(tmp_path / "none"), "-n", "2"]) == 2
    assert capsys.readouterr().err.startswith("ckpt plan: error: ")
    with pytest.raises(PlanError, match="world size must be a positive integer"):
        plan_load(str(tmp_path), 0)
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", str(tmp_path), "-n", "0"])
    assert info.value.code == 2
