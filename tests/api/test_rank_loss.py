"""A rank whose process ends in the middle of a collective save or load (os._exit in its shard
write or read) makes every surviving rank raise RankLostError naming the step and the rank that
disappeared (found by a roll call in the rendezvous store), within seconds, never a raw gloo
RuntimeError or a hang. Nothing is committed and `latest` does not move."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointManager, RankLostError
from ckptlib.format import MANIFEST_NAME
from ckptlib.format.native.root import step_dir
from ckptlib.testing import RankExited

EXIT_CODE = 7


def _state(step: int) -> dict:
    return {"w": torch.full((8, 4), float(step)), "step": step}


def _exit_in_shard_write() -> None:
    from ckptlib.storage.local import LocalStorage

    original = LocalStorage.open_writer

    @contextlib.contextmanager
    def open_writer(self, path):
        with original(self, path) as stream:
            stream.write(b"\0" * 64)
            stream.flush()
            os._exit(EXIT_CODE)
            yield stream

    LocalStorage.open_writer = open_writer


def _save_and_lose(root: str, victim: int, how: str) -> dict:
    # The thread writer: the death is injected into this process's shard write (the default
    # writer process writes the shard itself; its own death is tests/api/test_async_process*.py's)
    mgr = CheckpointManager(root, async_save=ckptlib.AsyncMode("thread") if how == "manager-async" else False)
    first = mgr.save(1, _state(1))
    if how == "manager-async":
        first.wait(timeout=60)
    if dist.get_rank() == victim:
        _exit_in_shard_write()
    try:
        if how == "save":
            ckptlib.save(os.path.join(root, "plain"), _state(2), step=2)
        elif how == "save-async":
            ckptlib.async_save(os.path.join(root, "plain"), _state(2), step=2, async_mode="thread").wait(timeout=60)
        elif how == "manager":
            mgr.save(2, _state(2))
        else:
            mgr.save(2, _state(2)).wait(timeout=60)
    except RankLostError as exc:
        return {"message": str(exc), "ranks": exc.ranks, "step": exc.step}
    return {"message": "no error"}


SAVE_CASES = [
    (how, world, victim)
    for how in ("save", "save-async", "manager", "manager-async")
    for world, victim in ((2, 1), (3, 1))
] + [("manager", 2, 0)]


def _survivor_crashed(results: list, victim: int) -> bool:
    return any(
        isinstance(seen, RankExited) and seen.exitcode == -11 for rank, seen in enumerate(results) if rank != victim
    )


def _latest_step(root: str):
    return CheckpointManager(root).latest()


@pytest.mark.parametrize(
    "how, world, victim", SAVE_CASES, ids=[f"{how}{world}-victim{victim}" for how, world, victim in SAVE_CASES]
)
def test_survivors_of_a_rank_dying_mid_save_raise_rank_lost(tmp_path, dist_run, world, victim, how):
    root = str(tmp_path / "run")
    results = dist_run(world, _save_and_lose, root, victim, how, return_exceptions=True, grace=20, timeout=90)
    if how.endswith("async") and _survivor_crashed(results, victim):
        # Seen about once in 30 runs on a loaded machine, with either async entry point: the
        # survivor's background save thread died with SIGSEGV inside gloo as the peer's
        # connection reset. Nothing may be committed then either; the scenario is re-run once
        # so a systematic crash still fails.
        if how == "save-async":
            assert not os.path.exists(os.path.join(root, "plain", MANIFEST_NAME))
        else:
            assert _latest_step(root) == 1
        root = str(tmp_path / "rerun")
        results = dist_run(world, _save_and_lose, root, victim, how, return_exceptions=True, grace=20, timeout=90)
    assert isinstance(results[victim], RankExited) and results[victim].exitcode == EXIT_CODE, results[victim]
    target = os.path.join(root, "plain") if how.startswith("save") else os.path.join(root, step_dir(2))
    for rank, seen in enumerate(results):
        if rank == victim:
            continue
        assert isinstance(seen, dict), (rank, seen)
        assert seen["ranks"] == [victim] and seen["step"] == 2, (rank, seen)
        assert f"failed on rank {rank}: rank {victim} disappeared (died, or lost its connection" in seen["message"]
        assert seen["message"].startswith(f"save of step 2 to {root}"), seen["message"]
    assert not os.path.exists(os.path.join(target, MANIFEST_NAME))
    mgr = CheckpointManager(root)
    assert mgr.latest() == 1 and mgr.steps() == [1]
    state = {"w": torch.zeros(8, 4), "step": 0}
    assert mgr.load(state) == 1 and torch.equal(state["w"], torch.full((8, 4), 1.0))


def _load_and_lose(uri: str, victim: int) -> dict:
    if dist.get_rank() == victim:  # dies where it would read (or, read once, receive) its items
        from ckptlib.format.read.dcp_reader import CkptReader

        def read_data(self, plan, planner):
            os._exit(EXIT_CODE)

        CkptReader.read_data = read_data
    try:
        ckptlib.load(uri, {"w": torch.zeros(8, 4), "step": 0})
    except RankLostError as exc:
        return {"message": str(exc), "ranks": exc.ranks}
    return {"message": "no error"}


@pytest.mark.parametrize("world, victim", [(2, 1), (3, 0)], ids=["load2-victim1", "load3-victim0"])
def test_survivors_of_a_rank_dying_mid_load_raise_rank_lost(tmp_path, dist_run, world, victim):
    uri = str(tmp_path / "c")
    ckptlib.save(uri, _state(4), step=4)
    results = dist_run(world, _load_and_lose, uri, victim, return_exceptions=True, grace=20, timeout=90)
    assert isinstance(results[victim], RankExited) and results[victim].exitcode == EXIT_CODE, results[victim]
    for rank, seen in enumerate(results):
        if rank != victim:
            assert isinstance(seen, dict) and seen["ranks"] == [victim], (rank, seen)
            assert seen["message"].startswith(f"load of {uri} failed on rank {rank}: rank {victim} disappeared")
