"""Interrupts are interrupts (issue 37): a KeyboardInterrupt or SystemExit on one rank during a
collective save or load is raised again as itself on that rank, short (no chain of DCP's
wrappers), and the other ranks get a RankInterruptedError naming it, not a rank that
"disappeared"; the save is cleaned up as after any failure and the committed steps stay.
A save that some (alive) ranks never call says it is collective and names them."""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointManager
from ckptlib._runtime import agree as _dist

INTERRUPTS = {"ctrl-c": KeyboardInterrupt, "exit": SystemExit}


def _outcome(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "ranks": list(getattr(exc, "ranks", [])),
        "traceback_lines": len(traceback.format_exception(exc)),
        "chained": exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__),
    }


def _interrupted_write(root: str, kind: str, victim: int) -> dict:
    import ckptlib.storage.local as local_storage

    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.full((64,), 1.0), "step": 1})
    if dist.get_rank() == victim:

        def interrupted(self, path):
            raise INTERRUPTS[kind]()

        local_storage.LocalStorage.open_writer = interrupted
    try:
        mgr.save(2, {"w": torch.full((64,), 2.0), "step": 2})
    except BaseException as exc:  # noqa: BLE001 - what each rank got is the result
        return _outcome(exc)
    return {"type": None}


@pytest.mark.parametrize("kind", sorted(INTERRUPTS))
def test_an_interrupt_during_a_save_is_itself_there_and_named_elsewhere(tmp_path, dist_run, kind):
    root = str(tmp_path / "run")
    victim = 1
    results = dist_run(2, _interrupted_write, root, kind, victim)
    got, other = results[victim], results[1 - victim]
    assert got["type"] == INTERRUPTS[kind].__name__ and not got["chained"], got
    assert got["traceback_lines"] <= 10, got  # a short report, not DCP's chain
    assert other["type"] == "RankInterruptedError" and other["ranks"] == [victim], other
    assert other["message"] == (
        f"rank {victim} was interrupted ({INTERRUPTS[kind].__name__}): the collective call stopped on every rank"
    )
    mgr = CheckpointManager(root)  # cleaned up: step 2 never committed, step 1 intact
    assert mgr.steps() == [1] and not os.path.exists(os.path.join(root, "step_0000000002", "ckptlib.json"))
    state = {"w": torch.zeros(64), "step": 0}
    assert mgr.load(state) == 1 and torch.equal(state["w"], torch.full((64,), 1.0))


def _interrupted_agreement(victim: int) -> dict:
    def decide():
        if dist.get_rank() == victim:
            raise KeyboardInterrupt
        return "decided"

    try:
        return {"type": None, "value": _dist.agree(decide)}
    except BaseException as exc:  # noqa: BLE001
        return _outcome(exc)


def test_an_interrupt_inside_an_agreement_reaches_every_rank_as_an_interruption(dist_run):
    results = dist_run(3, _interrupted_agreement, 2)
    assert results[2]["type"] == "KeyboardInterrupt" and not results[2]["chained"], results[2]
    for rank in (0, 1):
        assert results[rank]["type"] == "RankInterruptedError" and results[rank]["ranks"] == [2], results[rank]
        assert results[rank]["message"] == "rank 2 was interrupted (KeyboardInterrupt)"


def _interrupted_read(uri: str, victim: int) -> dict:
    from ckptlib.format.read.dcp_reader import CkptReader

    if dist.get_rank() == victim:  # Ctrl-C while this rank reads its file

        def read_file(self, name, reqs, planner):
            raise KeyboardInterrupt

        CkptReader._read_file = read_file
    try:
        ckptlib.load(uri, {"w": torch.zeros(64)}, read_once=False)  # every rank reads
    except BaseException as exc:  # noqa: BLE001
        return _outcome(exc)
    return {"type": None}


def test_an_interrupt_during_a_load_is_itself_there_and_named_elsewhere(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    ckptlib.save(uri, {"w": torch.ones(64)})
    results = dist_run(2, _interrupted_read, uri, 0)
    assert results[0]["type"] == "KeyboardInterrupt" and not results[0]["chained"], results[0]
    assert results[1]["type"] == "RankInterruptedError" and results[1]["ranks"] == [0], results[1]
    assert (
        results[1]["message"] == "rank 0 was interrupted (KeyboardInterrupt): the collective call stopped on every rank"
    )


def _save_on_rank_0_only(root: str) -> dict:
    from ckptlib._torch import c10d

    mgr = CheckpointManager(root)

    store = c10d.default_store()
    if dist.get_rank() == 0:
        try:
            mgr.save(1, {"w": torch.ones(8), "step": 1})
        except BaseException as exc:  # noqa: BLE001
            return _outcome(exc)
        finally:
            store.set("test/rank0-done", "1")
        return {"type": None}
    while not store.check(["test/rank0-done"]):  # alive, elsewhere (as a rank training on would be)
        time.sleep(0.1)
    return {"type": "waited"}


def test_a_save_called_on_one_rank_only_says_it_is_collective(tmp_path, dist_run):
    """Found by the check-in at the call (CKPTLIB_CALL_GRACE), long before the process group's
    timeout (here 10 minutes)."""
    root = str(tmp_path / "run")
    results = dist_run(2, _save_on_rank_0_only, root, pg_timeout=600, env={"CKPTLIB_CALL_GRACE": "3"}, timeout=120)
    got = results[0]
    assert got["type"] == "NotCalledByEveryRankError" and got["ranks"] == [1], got
    assert got["message"] == (
        f"save of step 1 to {root} on rank 0: it is a collective call, which every rank of its group must make, "
        "and rank 1 (alive) did not make it within 3 s (CKPTLIB_CALL_GRACE)"
    ), got["message"]
    assert results[1] == {"type": "waited"}
    assert CheckpointManager(root).steps() == []


def test_without_the_check_in_the_process_groups_timeout_says_it(tmp_path, dist_run):
    root = str(tmp_path / "run")
    results = dist_run(2, _save_on_rank_0_only, root, pg_timeout=8, env={"CKPTLIB_CALL_GRACE": "0"}, timeout=120)
    got = results[0]
    assert got["type"] == "NotCalledByEveryRankError" and got["ranks"] == [1], got
    assert got["message"].startswith(
        f"save of step 1 to {root} failed on rank 0: it is a collective call, which every rank "
        "must make, and rank 1 (alive) did not make it within the process group's timeout"
    ), got["message"]
