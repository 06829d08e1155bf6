"""CheckpointManager: step directories, the single `latest` pointer, retention, autoresume."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointExistsError, CheckpointManager, StalePointerWarning
from ckptlib.errors import CheckpointNotFoundError


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
    with pytest.warns(StalePointerWarning, match="points to 'step_0000000002', which is not a committed checkpoint; using step 1"):
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
