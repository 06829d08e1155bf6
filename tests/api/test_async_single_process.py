"""async_save in one process, without launching ranks: when the state is copied (before the
call returns, or in the background with background_staging=True), the timings the handle
and the SaveResult report, and the refusal to overwrite. The background write is held back
where a test needs the copy to be the only thing that protects the checkpoint."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import ckptlib
from ckptlib import CheckpointExistsError
from ckptlib.saving import saving


def _hold_background_writes(monkeypatch) -> threading.Event:
    """Background writes wait for the returned event; writes in the caller's thread do not."""
    gate = threading.Event()
    original = saving._write

    def held(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            assert gate.wait(60), "the test never released the background write"
        return original(*args, **kwargs)

    monkeypatch.setattr(saving, "_write", held)
    return gate


def _load(path, n: int = 1000, **plain) -> dict:
    state = {"w": torch.zeros(n), **plain}
    ckptlib.load(path, state)
    return state


def test_async_save_copies_the_state_before_it_returns(tmp_path, monkeypatch):
    """The caller may change the state as soon as async_save returns, and a synchronous save
    in the meantime (same keys and shapes) does not touch the copy the background writes."""
    gate = _hold_background_writes(monkeypatch)
    weights = torch.arange(1000, dtype=torch.float32)
    state = {"w": weights, "epoch": 3}
    started = time.perf_counter()
    handle = ckptlib.async_save(tmp_path / "a", state, step=4)
    returned = time.perf_counter() - started
    try:
        assert 0 < handle.blocking_seconds <= returned
        assert handle.staged_seconds == handle.blocking_seconds  # staged before the call returned
        weights.add_(1)
        state["epoch"] = 99
        ckptlib.save(tmp_path / "b", {"w": torch.full((1000,), -1.0), "epoch": 5})
    finally:
        gate.set()
    result = handle.wait(timeout=60)
    total = time.perf_counter() - started
    assert (result.step, result.world_size) == (4, 1)
    assert 0 < result.seconds <= total
    assert result.blocked_seconds == handle.blocking_seconds
    got = _load(tmp_path / "a", epoch=0)
    assert torch.equal(got["w"], torch.arange(1000, dtype=torch.float32)) and got["epoch"] == 3
    other = _load(tmp_path / "b", epoch=0)
    assert torch.equal(other["w"], torch.full((1000,), -1.0)) and other["epoch"] == 5


def test_background_staging_copies_before_wait_staged_returns(tmp_path):
    weights = torch.arange(1000, dtype=torch.float32)
    started = time.perf_counter()
    handle = ckptlib.async_save(tmp_path / "a", {"w": weights, "epoch": 3}, background_staging=True)
    handle.wait_staged(timeout=30)
    staged_bound = time.perf_counter() - started
    assert handle.blocking_seconds <= handle.staged_seconds <= staged_bound
    weights.add_(1)
    result = handle.wait(timeout=60)
    assert result.blocked_seconds == handle.blocking_seconds
    got = _load(tmp_path / "a", epoch=0)
    assert torch.equal(got["w"], torch.arange(1000, dtype=torch.float32)) and got["epoch"] == 3


def test_async_save_refuses_to_overwrite_committed(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(2)})
    handle = ckptlib.async_save(tmp_path / "c", {"w": torch.zeros(2)})
    with pytest.raises(CheckpointExistsError, match="already holds a committed checkpoint"):
        handle.wait(timeout=60)
    assert _load(tmp_path / "c", 2)["w"].tolist() == [1.0, 1.0]
    ckptlib.async_save(tmp_path / "c", {"w": torch.full((2,), 5.0)}, overwrite=True).wait(timeout=60)
    assert _load(tmp_path / "c", 2)["w"].tolist() == [5.0, 5.0]
