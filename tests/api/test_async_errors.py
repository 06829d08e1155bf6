"""An async save's failure is delivered exactly once: by whichever of the handle's wait() /
result() / exception(), the manager's wait() / save() / gc() / close(), or the next async save
sees it first. The call that sees it raises it; every later call proceeds (the next save runs
and commits), and nothing is left committed or published by the failed save."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib.format import MANIFEST_NAME
from ckptlib.format.native.root import step_dir
from ckptlib.storage.local import LocalStorage


def _fail_writes_under(monkeypatch, name: str) -> None:
    """Every shard write below a directory called `name` fails with EIO (the background runs it)."""
    original = LocalStorage.open_writer

    def broken(self, path):
        if os.path.basename(self.root.rstrip("/")) == name:
            raise OSError(5, "EIO (injected)")
        return original(self, path)

    monkeypatch.setattr(LocalStorage, "open_writer", broken)


def _state(seed: int) -> dict:
    return {"w": torch.full((64, 8), float(seed)), "n": seed}


def _observe_handle(handle, how: str) -> None:
    if how == "exception":
        assert "EIO (injected)" in str(handle.exception(timeout=60))
        return
    with pytest.raises(ckptlib.CheckpointError, match=r"EIO \(injected\)"):
        handle.wait(timeout=60) if how == "wait" else handle.result()


@pytest.mark.parametrize("observer", ["wait", "result", "exception"])
def test_save_async_failure_seen_by_handle_is_not_raised_again_by_next_save(tmp_path, monkeypatch, observer):
    _fail_writes_under(monkeypatch, "bad")
    failed = ckptlib.async_save(str(tmp_path / "bad"), _state(1), step=1)
    _observe_handle(failed, observer)
    good = ckptlib.async_save(str(tmp_path / "good"), _state(2), step=2)  # does not raise step 1's error
    assert good.wait(timeout=60).step == 2
    loaded = {"w": torch.zeros(64, 8), "n": 0}
    assert ckptlib.load(str(tmp_path / "good"), loaded).step == 2 and loaded["n"] == 2
    assert torch.equal(loaded["w"], torch.full((64, 8), 2.0))
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()


MANAGER_OBSERVERS = ["handle.wait", "handle.result", "manager.wait", "manager.save", "manager.gc", "manager.close"]


@pytest.mark.parametrize("observer", MANAGER_OBSERVERS)
def test_manager_async_failure_is_delivered_once_then_the_next_save_runs(tmp_path, monkeypatch, observer):
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, _state(1)).wait(timeout=60)
    _fail_writes_under(monkeypatch, step_dir(2))
    mgr = ckptlib.CheckpointManager(root, async_save=True)
    handle = mgr.save(2, _state(2))
    handle._done.wait(60)
    with pytest.raises(ckptlib.CheckpointError, match=r"EIO \(injected\)"):
        if observer == "handle.wait":
            handle.wait()
        elif observer == "handle.result":
            handle.result()
        elif observer == "manager.wait":
            mgr.wait()
        elif observer == "manager.save":
            mgr.save(3, _state(3))  # raises step 2's failure and does not save step 3
        elif observer == "manager.gc":
            mgr.gc()
        else:
            mgr.close()
    assert mgr.latest() == 1
    # delivered: nothing raises it again, and the next save goes ahead
    assert mgr.wait() is None
    if observer == "manager.close":
        mgr.close()
        mgr = ckptlib.CheckpointManager(root, async_save=True)
    assert mgr.steps() in ([1], [1, 2])  # step 2 may be left as uncommitted debris until the next save
    mgr.save(3, _state(3)).wait(timeout=60)
    mgr.close()
    assert ckptlib.CheckpointManager(root).latest() == 3
    assert not (root / step_dir(2) / MANIFEST_NAME).exists()
    loaded = {"w": torch.zeros(64, 8), "n": 0}
    assert ckptlib.CheckpointManager(root).load(loaded) == 3 and loaded["n"] == 3


def _manager_failure_seen_by_handle(root: str) -> dict:
    """Rank 1's writes of step 2 fail; every rank sees it from handle.wait(), then saves step 3."""
    if dist.get_rank() == 1:
        original = LocalStorage.open_writer

        def broken(self, path):
            if step_dir(2) in self.root:
                raise OSError(5, "EIO (injected)")
            return original(self, path)

        LocalStorage.open_writer = broken
    # the fault is patched into this process: the thread writer (the writer process's: test_async_process*.py)
    mgr = ckptlib.CheckpointManager(root, async_save=ckptlib.AsyncMode("thread"))
    mgr.save(1, _state(1)).wait(timeout=60)
    handle = mgr.save(2, _state(2))
    try:
        handle.wait(timeout=60)
        error = None
    except ckptlib.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    mgr.save(3, _state(3)).wait(timeout=60)  # step 2's failure is not raised again
    out = {"error": error, "latest": mgr.latest(), "steps": mgr.steps()}
    mgr.close()
    return out


def test_manager_async_failure_seen_by_handle_on_every_rank_then_next_save_runs(tmp_path, dist_run):
    root = str(tmp_path / "run")
    for rank, seen in enumerate(dist_run(2, _manager_failure_seen_by_handle, root)):
        assert seen["error"] is not None and "EIO (injected)" in seen["error"], (rank, seen)
        assert seen["latest"] == 3 and seen["steps"] == [1, 3], (rank, seen)
