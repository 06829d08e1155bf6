"""Read once, exchange over the process group: an item several ranks need is read from storage by
one rank and sent to the others; `LoadResult` says what each rank read and received.

Plain replicated state here (every rank saves and loads the same tensors and objects); the
parallel layouts (DDP, HSDP, FSDP2+TP) on local disk and S3 are in tests/elastic/test_read_once.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ckptlib

MIB = 1 << 20


def _state(fill: float) -> dict:
    return {
        "model": {f"w{i}": torch.full((64 + i, 1024), fill + i) for i in range(6)},
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
    }


def test_replicated_state_is_read_once(tmp_path, dist_run):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    once = dist_run(4, _load_and_report, path, {}, timeout=120)
    every = dist_run(4, _load_and_report, path, {"read_once": False}, timeout=120)
    needed = once[0]["needed"]
    assert needed > 6 * 64 * 1024 * 4
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


def test_a_single_process_load_reports_its_reads(tmp_path):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    state = _state(-1.0)
    result = ckptlib.load(path, state)
    assert torch.equal(state["model"]["w5"], _state(0.0)["model"]["w5"])
    assert result.storage_bytes_read == result.bytes_needed == sum(result.storage_bytes_read_by_rank)
    assert result.bytes_by_source == {"local": result.bytes_needed} and result.bytes_received == 0
