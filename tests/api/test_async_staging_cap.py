"""AsyncMode(max_staging_bytes=N): a save of a state several times N holds at most N bytes of
staging (the high-water counter on the SaveResult, and the writer process's shared memory), writes
the bytes a synchronous save writes and loads back bit-exactly, in both writers, with and without
background staging, at one rank and at two; the state may change once the call returned; a
tensor larger than N and a bad N are refused with the exact error, before anything is written;
a write failing mid-stream fails the save cleanly and the writer serves the next one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.saved_state import assert_equal, shard_bytes
from helpers.writer_faults import FaultyShards

import ckptlib
from ckptlib import AsyncMode, StagingCapError, StateError, StorageError
from ckptlib.format import MANIFEST_NAME
from ckptlib.saving import background_save, staging_arena, writer_process

needs_memfd = pytest.mark.skipif(
    staging_arena.unavailable_reason() is not None, reason=str(staging_arena.unavailable_reason())
)
PIECE = 64 * 1024 * 4  # bytes of one "t{i}" tensor
CAP = 3 * PIECE + 100  # three pieces fit, not four
WRITERS = ["thread", pytest.param("process", marks=needs_memfd)]


@pytest.fixture(autouse=True)
def _no_writer_left():
    background_save.release_staging()
    yield
    background_save.release_staging()


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    state: dict = {f"t{i}": torch.randn(64 * 1024, generator=gen) for i in range(24)}  # 6 MiB: 8x the cap
    state["half"] = torch.randn(300, 7, generator=gen).to(torch.bfloat16)
    state["empty"] = torch.zeros(0, 5)
    state["transposed"] = torch.randn(40, 30, generator=gen).t()
    state["objects"] = {"epoch": seed, "name": f"run-{seed}"}
    return state


def _zeros_like(state: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    out["objects"] = {"epoch": 0, "name": ""}
    return out


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("writer", WRITERS)
def test_a_capped_save_holds_at_most_the_cap_and_loads_back_bit_exact(tmp_path, writer, background):
    state = _state(1)
    shard = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert shard > 8 * CAP
    handle = ckptlib.async_save(
        tmp_path / "capped", state, step=1, async_mode=writer, background_staging=background, max_staging_bytes=CAP
    )
    handle.wait_staged(timeout=120)
    with torch.no_grad():  # the training step right after the copy: not in the checkpoint
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.add_(1)
    result = handle.wait(timeout=120)
    expected_peak = 3 * PIECE if writer == "process" else PIECE  # a writer process pipelines the pieces
    assert result.staging_peak_bytes == expected_peak <= CAP
    if writer == "process":
        assert writer_process.current().arena.mapped_bytes() <= CAP
        assert writer_process.current().bytes_sent_whole == 0  # every piece read from shared memory
    ckptlib.save(tmp_path / "sync", _state(1), step=1)
    assert shard_bytes(tmp_path / "capped") == shard_bytes(tmp_path / "sync")
    got = _zeros_like(state)
    assert ckptlib.load(tmp_path / "capped", got).step == 1
    assert_equal(got, _state(1))


def test_an_uncapped_save_reports_the_whole_shard_as_its_staging_peak(tmp_path):
    state = _state(2)
    shard = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert ckptlib.async_save(tmp_path / "a", state, async_mode="thread").wait(timeout=120).staging_peak_bytes == shard
    assert ckptlib.save(tmp_path / "b", state).staging_peak_bytes is None


@pytest.mark.parametrize("writer", WRITERS)
def test_the_manager_saves_capped_steps(tmp_path, writer):
    with ckptlib.CheckpointManager(tmp_path, async_save=AsyncMode(writer, max_staging_bytes=CAP), keep_last=1) as m:
        for step in (1, 2):
            assert m.save(step, _state(step)).wait(timeout=120).staging_peak_bytes <= CAP
        got = _zeros_like(_state(0))
        assert m.load(got) == 2
    assert_equal(got, _state(2))


@pytest.mark.parametrize("writer", WRITERS)
def test_a_tensor_larger_than_the_cap_is_refused_before_anything_is_written(tmp_path, writer):
    target = tmp_path / "ckpt"
    with pytest.raises(StagingCapError) as info:
        ckptlib.async_save(target, _state(1), async_mode=writer, max_staging_bytes=PIECE - 1)
    assert str(info.value) == (
        f"tensor 't0' on rank 0 is {PIECE} bytes, more than AsyncMode(max_staging_bytes={PIECE - 1}): "
        f"a capped save stages whole tensors (raise the cap to at least {PIECE}, or shard the tensor); "
        f"nothing was written to {target}"
    )
    assert (info.value.key, info.value.nbytes, info.value.cap, info.value.rank) == ("t0", PIECE, PIECE - 1, 0)
    assert isinstance(info.value, StateError) and not target.exists()
    ckptlib.async_save(target, _state(1), async_mode=writer, max_staging_bytes=PIECE).wait(timeout=120)


@pytest.mark.parametrize("cap", [0, -5, 1.5, True, "1024"])
def test_a_bad_cap_is_refused(cap):
    with pytest.raises(StateError) as info:
        AsyncMode(max_staging_bytes=cap)
    assert str(info.value) == f"AsyncMode max_staging_bytes must be a positive int (bytes) or None, got {cap!r}"


def test_async_save_checks_its_cap_too(tmp_path):
    with pytest.raises(StateError, match=r"max_staging_bytes must be a positive int \(bytes\) or None, got 0$"):
        ckptlib.async_save(tmp_path / "x", _state(1), max_staging_bytes=0)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("writer", WRITERS)
def test_a_write_error_mid_stream_fails_the_save_and_the_next_one_commits(tmp_path, writer):
    target = tmp_path / "bad"
    storage = FaultyShards(str(target), "eio", after=5 * PIECE)  # fails with pieces in flight
    handle = ckptlib.async_save(storage, _state(1), async_mode=writer, max_staging_bytes=CAP)
    with pytest.raises(StorageError) as info:
        handle.wait(timeout=120)
    assert str(info.value) == f"rank 0: cannot write {target}/__0_0.distcp: EIO (injected)"
    left = sorted(os.listdir(target)) if target.exists() else []
    assert MANIFEST_NAME not in left and not [n for n in left if n.endswith(".distcp")], left
    pid = writer_process.current().pid if writer == "process" else None
    ckptlib.async_save(tmp_path / "next", _state(2), step=2, async_mode=writer, max_staging_bytes=CAP).wait(timeout=120)
    assert (writer_process.current().pid if writer == "process" else None) == pid  # the same writer
    got = _zeros_like(_state(2))
    ckptlib.load(tmp_path / "next", got)
    assert_equal(got, _state(2))


def _capped_round(uri: str, writer: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(64, 8192, generator=torch.Generator().manual_seed(5))  # 2 MiB, 1 MiB a rank
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 3}
    cap = 300 * 1024
    with pytest.raises(StagingCapError):  # 1 MiB a rank in one tensor: refused on every rank
        ckptlib.async_save(uri, state, async_mode=writer, max_staging_bytes=cap)
    pieces = {
        f"p{i}": distribute_tensor(full[:, i * 1024 : (i + 1) * 1024].contiguous(), mesh, [Shard(0)]) for i in range(8)
    }
    result = ckptlib.async_save(uri, {**pieces, "step": 3}, step=3, async_mode=writer, max_staging_bytes=cap).wait(
        timeout=120
    )
    got = {k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, [Shard(0)]) for k, v in pieces.items()}
    ckptlib.load(uri, {**got, "step": 0})
    same = all(torch.equal(got[k].full_tensor(), v.full_tensor()) for k, v in pieces.items())
    background_save.release_staging()
    return {"peak_within_cap": 0 < result.staging_peak_bytes <= cap, "same": same}


@pytest.mark.parametrize("writer", WRITERS)
def test_capped_saves_at_two_ranks(tmp_path, dist_run, writer):
    assert dist_run(2, _capped_round, str(tmp_path / "ckpt"), writer) == [{"peak_within_cap": True, "same": True}] * 2
