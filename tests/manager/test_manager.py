"""CheckpointManager: step directories, the single `latest` pointer, retention, autoresume."""

from __future__ import annotations

import functools
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointExistsError, CheckpointManager, StalePointerWarning
from ckptlib.errors import CheckpointNotFoundError
from ckptlib.manager.cleanup import ForeignFilesWarning
from ckptlib.manager.lock import StaleLockWarning


def _state(value: float) -> dict:
    return {"w": torch.full((3,), float(value)), "step": int(value)}


def _load_w(mgr: CheckpointManager, step=None):
    state = {"w": torch.zeros(3), "step": -1}
    got = mgr.load(state, step)
    return got, state


def test_latest_is_one_relative_symlink(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(1, _state(1))
    mgr.save(20, _state(20))
    link = tmp_path / "run" / "latest"
    assert os.path.islink(link) and os.readlink(link) == "step_0000000020"
    assert sorted(os.listdir(tmp_path / "run")) == ["latest", "step_0000000001", "step_0000000020"]
    assert mgr.steps() == [1, 20] and mgr.latest() == 20
    got, state = _load_w(mgr)
    assert got == 20 and state["step"] == 20 and torch.equal(state["w"], torch.full((3,), 20.0))
    got, state = _load_w(mgr, 1)
    assert got == 1 and torch.equal(state["w"], torch.ones(3))


def test_autoresume_on_missing_and_empty_root(tmp_path):
    with pytest.warns(ckptlib.FreshStartWarning, match="never-created: nothing to resume .it does not exist."):
        assert CheckpointManager(tmp_path / "never-created").load(_state(0)) is None
    (tmp_path / "empty").mkdir()
    mgr = CheckpointManager(tmp_path / "empty")
    assert mgr.latest() is None and mgr.steps() == [] and mgr.load(_state(0)) is None


def test_autoresume_skips_debris_and_next_save_cleans_it(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    debris = root / "step_0000000002"
    debris.mkdir()
    (debris / "ckptlib.pending").write_text("{}")
    (debris / "__0_0.distcp").write_bytes(b"half")
    assert mgr.steps() == [1]
    got, state = _load_w(mgr)
    assert got == 1 and torch.equal(state["w"], torch.ones(3))
    mgr.save(3, _state(3))
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000003"]


def test_only_debris_means_fresh_start(tmp_path):
    root = tmp_path / "run"
    (root / "step_0000000005").mkdir(parents=True)
    (root / "step_0000000005" / "ckptlib.pending").write_text("{}")
    assert CheckpointManager(root).load(_state(0)) is None


def test_retention_keeps_newest(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=2)
    for step in range(1, 6):
        mgr.save(step, _state(step))
    assert sorted(os.listdir(root)) == ["latest", "step_0000000004", "step_0000000005"]
    assert mgr.steps() == [4, 5]


def test_retention_never_deletes_latest(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(5, _state(5))
    mgr.save(3, _state(3))  # a rollback: the run resumed from an older step
    assert sorted(os.listdir(root)) == ["latest", "step_0000000003", "step_0000000005"]
    assert mgr.latest() == 3
    mgr.save(4, _state(4))
    assert sorted(os.listdir(root)) == ["latest", "step_0000000004", "step_0000000005"]


def test_stale_pointer_falls_back_with_warning(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    (root / "step_0000000002" / "ckptlib.json").unlink()
    with pytest.warns(
        StalePointerWarning, match="points to 'step_0000000002', which is not a committed checkpoint; using step 1"
    ):
        got, state = _load_w(mgr)
    assert got == 1 and torch.equal(state["w"], torch.ones(3))


def test_saving_an_existing_step_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(7, _state(7))
    with pytest.raises(CheckpointExistsError, match="step_0000000007 already holds a committed checkpoint"):
        mgr.save(7, _state(99))
    got, state = _load_w(mgr, 7)
    assert torch.equal(state["w"], torch.full((3,), 7.0))


def test_committed_but_unpublished_step_can_be_saved_again(tmp_path):
    """A crash after step 6 committed but before `latest` moved: the run resumes from step 3,
    trains to 6 again and must be able to save it (it would otherwise be stuck)."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(3, _state(3))
    ckptlib.save(root / "step_0000000006", _state(6), step=6)  # committed, pointer not moved
    got, _ = _load_w(mgr)
    assert got == 3
    with pytest.warns(StalePointerWarning, match="step_0000000006 is committed but latest names 'step_0000000003'"):
        mgr.save(6, _state(66))
    got, state = _load_w(mgr)
    assert got == 6 and torch.equal(state["w"], torch.full((3,), 66.0))
    assert sorted(os.listdir(root)) == ["latest", "step_0000000003", "step_0000000006"]


def test_loading_an_absent_step(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(1, _state(1))
    with pytest.raises(CheckpointNotFoundError, match="has no step 4"):
        mgr.load(_state(0), 4)


def test_gc_dry_run_and_real(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    pruner = CheckpointManager(root, keep_last=1)
    assert pruner.gc(dry_run=True) == ["step_0000000001", "step_0000000002"]
    assert mgr.steps() == [1, 2, 3]
    assert pruner.gc() == ["step_0000000001", "step_0000000002"]
    assert sorted(os.listdir(root)) == ["latest", "step_0000000003"]


def _save_steps_then_report(root: str, steps: list[int], keep_last):
    mgr = CheckpointManager(root, keep_last=keep_last)
    rank = dist.get_rank()
    for step in steps:
        mgr.save(step, {"w": torch.full((2,), float(step * 10 + rank)), "rng": ckptlib.RNGState()})
    return sorted(os.listdir(root))


def _resume(root: str):
    state = {"w": torch.zeros(2), "rng": ckptlib.RNGState()}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptlib.ResizeWarning)
        step = CheckpointManager(root).load(state)
    return step, state["w"].tolist()


def test_multi_rank_single_pointer_and_resume_on_fewer_ranks(tmp_path, dist_run):
    """One pointer written by rank 0, read by all: resizing 4 -> 2 -> 4 never reads a stale one
    (per-rank pointers did: mosaicml/composer#2409)."""
    root = str(tmp_path / "run")
    listings = dist_run(4, _save_steps_then_report, root, [1, 2, 3], 2)
    assert listings == [["latest", "step_0000000002", "step_0000000003"]] * 4
    # Replicated "w" is deduplicated: the value of the rank that DCP picked, the same for all.
    resumed = dist_run(2, _resume, root)
    assert {r[0] for r in resumed} == {3} and resumed[0][1] == resumed[1][1]
    dist_run(2, _save_steps_then_report, root, [4], 2)
    resumed = dist_run(4, _resume, root)
    assert [r[0] for r in resumed] == [4] * 4


# ---------------------------------------------------------------- what a new manager reports


def test_a_new_manager_has_loaded_nothing_and_seen_no_signal(tmp_path):
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    mgr = CheckpointManager(tmp_path / "run")  # save_on_preemption defaults to False: no handler
    assert {s: signal.getsignal(s) for s in before} == before
    assert (mgr.initial_loaded, mgr.preempted, mgr.preemption_signal) == (False, False, None)
    with pytest.warns(ckptlib.FreshStartWarning):  # a root that does not exist, no initial_load
        assert mgr.load(_state(0)) is None
    assert (mgr.initial_loaded, mgr.preempted) == (False, False)
    assert mgr.maybe_save(1, _state(1)) is False  # no policy, no signal: no save
    assert (mgr.preempted, mgr.preemption_signal) == (False, None)
    assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") == []
    mgr.close()


# ---------------------------------------------------------------- latest without a pointer


@pytest.mark.parametrize("steps", [[4], [4, 9], [2, 4, 9]], ids=["one-step", "two-steps", "three-steps"])
def test_without_a_pointer_latest_is_the_newest_committed_step(tmp_path, recwarn, steps):
    """A crash before the first pointer was written, or a root copied without `latest`."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step in steps:
        mgr.save(step, _state(step))
    (root / "latest").unlink()
    assert mgr.latest() == steps[-1]
    got, state = _load_w(mgr)
    assert got == steps[-1] and torch.equal(state["w"], torch.full((3,), float(steps[-1])))
    assert [w for w in recwarn if issubclass(w.category, StalePointerWarning)] == []


# ---------------------------------------------------------------- async wait


def test_wait_delivers_an_async_save_once(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", async_save=True)
    handle = mgr.save(3, _state(3))
    result = mgr.wait()
    assert result is handle.result() and result.step == 3
    assert mgr.wait() is None  # nothing in flight any more
    assert mgr.steps() == [3] and mgr.latest() == 3
    mgr.close()


# ---------------------------------------------------------------- warnings name the caller's line


def _stale_pointer(root):
    mgr = CheckpointManager(root)
    mgr.save(3, _state(3))
    mgr.save(6, _state(6))
    (root / "step_0000000006" / "ckptlib.json").unlink()
    return mgr


def _unpublished_step_6(root):
    mgr = CheckpointManager(root)
    mgr.save(3, _state(3))
    ckptlib.save(root / "step_0000000006", _state(6), step=6)  # committed, pointer not moved
    return mgr


def _users_file_in_step_1(root):
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    (root / "step_0000000001" / "eval.txt").write_text("loss 0.1")
    return CheckpointManager(root, keep_last=1)


def _users_file_in_step_1_then_step_2(root):
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    (root / "step_0000000001" / "eval.txt").write_text("loss 0.1")
    return CheckpointManager(root, keep_last=1)


def _lock_cannot_be_removed(root, monkeypatch):
    from helpers.manager import refuse_lock_deletion

    refuse_lock_deletion(monkeypatch)
    return CheckpointManager(root)


def _stale_lock_of_an_exited_process(root):
    import json
    import socket

    from ckptlib.manager.lock import LOCK_NAME

    root.mkdir(parents=True)
    pid = os.getpid() + 1_000_000  # above pid_max: no process has it
    (root / LOCK_NAME).write_text(
        json.dumps(
            {
                "format": "ckptlib-lock",
                "host": socket.gethostname(),
                "pid": pid,
                "token": "t",
                "created": "2024-01-01T00:00:00+00:00",
            }
        )
    )
    return CheckpointManager(root)


def _bf16_step_1(root):
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.full((3,), 1.0, dtype=torch.bfloat16), "step": 1})
    return mgr


# (how the root is prepared, the call that warns, the warning and its message)
WARNING_CASES = {
    "stale-pointer-latest": (
        _stale_pointer,
        lambda mgr: functools.partial(mgr.latest),
        StalePointerWarning,
        "which is not a committed checkpoint; using step 3",
    ),
    "stale-pointer-load": (
        _stale_pointer,
        lambda mgr: functools.partial(mgr.load, _state(0)),
        StalePointerWarning,
        "which is not a committed checkpoint; using step 3",
    ),
    "replace-save": (
        _unpublished_step_6,
        lambda mgr: functools.partial(mgr.save, 6, _state(66)),
        StalePointerWarning,
        "step_0000000006 is committed but latest names 'step_0000000003'",
    ),
    "replace-maybe-save": (
        _unpublished_step_6,
        lambda mgr: functools.partial(mgr.maybe_save, 6, _state(66), force=True),
        StalePointerWarning,
        "step_0000000006 is committed but latest names 'step_0000000003'",
    ),
    "foreign-files-save": (
        _users_file_in_step_1,
        lambda mgr: functools.partial(mgr.save, 2, _state(2)),
        ForeignFilesWarning,
        "eval.txt",
    ),
    "foreign-files-gc": (
        _users_file_in_step_1_then_step_2,
        lambda mgr: functools.partial(mgr.gc),
        ForeignFilesWarning,
        "eval.txt",
    ),
    "lock-not-removed-save": (
        _lock_cannot_be_removed,
        lambda mgr: functools.partial(mgr.save, 1, _state(1)),
        StaleLockWarning,
        "could not remove the lock",
    ),
    "lock-not-removed-gc": (
        _lock_cannot_be_removed,
        lambda mgr: functools.partial(mgr.gc),
        StaleLockWarning,
        "could not remove the lock",
    ),
    "stale-lock-save": (
        _stale_lock_of_an_exited_process,
        lambda mgr: functools.partial(mgr.save, 1, _state(1)),
        StaleLockWarning,
        "removing a stale lock left by pid",
    ),
    "cast-load": (
        _bf16_step_1,
        lambda mgr: functools.partial(mgr.load, _state(0), cast=True),
        ckptlib.CastWarning,
        "converted to the dtypes the state asked for: w saved as",
    ),
}


@pytest.mark.parametrize("case", list(WARNING_CASES))
def test_manager_warnings_name_the_callers_line(tmp_path, monkeypatch, case):
    """However deep in the manager a warning is raised (the save, its retention, the lock), it
    names the line that called the manager, so a user can see and filter where it came from."""
    prepare, call, category, message = WARNING_CASES[case]
    root = tmp_path / "run"
    args = (root, monkeypatch) if prepare is _lock_cannot_be_removed else (root,)
    trigger = call(prepare(*args))
    with pytest.warns(category, match=message) as caught:
        line = sys._getframe().f_lineno + 1
        trigger()
    assert [(w.category, w.filename, w.lineno) for w in caught] == [(category, __file__, line)]


# ---------------------------------------------------------------- gc: progress, log, what it leaves


def test_gc_reports_progress_and_logs_the_removed_bytes(tmp_path, caplog):
    import logging

    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    leftover = root / "step_0000000007.deleting-0123abcd"  # a deletion that crashed half-way
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x" * 100)
    sizes = {s: sum(p.stat().st_size for p in (root / f"step_000000000{s}").iterdir()) for s in (1, 2)}
    calls = []
    started = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        removed = CheckpointManager(root, keep_last=1).gc(on_removed=lambda done, total: calls.append((done, total)))
    elapsed = time.perf_counter() - started
    assert removed == ["step_0000000001", "step_0000000002", "step_0000000007.deleting-0123abcd"]
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert sorted(os.listdir(root)) == ["latest", "step_0000000003"]
    [record] = [r for r in caplog.records if getattr(r, "ckptlib", {}).get("op") == "gc"]
    fields = record.ckptlib
    assert fields["bytes"] == sizes[1] + sizes[2]  # the leftover's size is unknown: counted 0
    assert fields["removed"] == 3 and fields["dry_run"] is False and fields["world_size"] == 1
    assert 0 <= fields["seconds"] <= elapsed


def test_gc_leaves_the_incomplete_step_latest_names_as_it_is(tmp_path):
    """A crash while overwriting the step `latest` names (its old files go first) leaves it
    incomplete; gc keeps it as it is, pending marker included, and still removes other debris."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, _state(step))
    crashed = root / "step_0000000002"
    for name in os.listdir(crashed):
        (crashed / name).unlink()
    (crashed / "ckptlib.pending").write_text("{}")
    (crashed / "__0_0.distcp").write_bytes(b"half")
    debris = root / "step_0000000005"
    debris.mkdir()
    (debris / "ckptlib.pending").write_text("{}")
    assert mgr.gc() == ["step_0000000005"]
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002"]
    assert sorted(os.listdir(crashed)) == ["__0_0.distcp", "ckptlib.pending"]
    assert sorted(os.listdir(root / "step_0000000001")) == [".metadata", "__0_0.distcp", "ckptlib.json"]
