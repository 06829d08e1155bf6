"""A load that races another process's retention: the other process saves step 6 and its
retention (keep_last=1) deletes step 5 just before each storage operation of
`manager.load(state)` in turn. Resuming from `latest` then loads step 5 whole (the deletion came
after everything was read) or retries on the new `latest` and loads step 6 whole, bit-exactly;
a load of an explicitly requested step 5 loads it or raises `CheckpointRemovedError` naming the
step (deleted before the load first looked: CheckpointNotFoundError "has no step 5"). Never a
raw FileNotFoundError, never CheckpointCorruptError for a step that was deleted rather than
damaged, never None ("nothing to resume") while a committed step exists.

Before: depending on the operation, the load returned None, raised a raw FileNotFoundError
(the manifest vanished between listing and reading), NotACheckpointError, or
CheckpointCorruptError ("shard file is missing").
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.interleave import Interleaved, InterleavedProxy, run_at_every_operation
from helpers.manager import step_state

from ckptlib import CheckpointManager
from ckptlib.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, CheckpointRemovedError
from ckptlib.format.native.root import step_dir
from ckptlib.storage import LocalStorage, is_remote


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def base(request, tmp_path) -> str:
    """Where each interleaving gets a root of its own: a local directory, or an S3 prefix."""
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("s3_root")


def _race(base: str, requested: int | None):
    counter = iter(range(10**6))

    def make(at):
        root = f"{base}/root{next(counter)}"
        other = CheckpointManager(root, keep_last=1)  # the other process: its own manager, same root
        other.save(5, step_state(5))
        reader = CheckpointManager(root)

        def interrupt() -> None:
            other.save(6, step_state(6))

        storage = (
            InterleavedProxy(reader.storage, at, interrupt) if is_remote(root) else Interleaved(root, at, interrupt)
        )
        reader.storage = reader.tier.storage = storage
        got = {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(7)}, "step": -1}

        def action():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step = reader.load(got, step=requested)
            return step, got, reader.last_load

        return storage, action

    return run_at_every_operation(make)


def _assert_loaded(step, got, last_load, expected_step):
    assert step == expected_step and last_load.step == expected_step
    want = step_state(expected_step)
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and torch.equal(got["model"]["b"], want["model"]["b"])
    assert got["step"] == expected_step


def test_resuming_from_latest_while_retention_deletes_it(base):
    outcomes = _race(base, None)
    assert len(outcomes) > 8, outcomes  # the load takes that many storage operations
    loaded = set()
    for k, op, outcome in outcomes:
        assert not isinstance(outcome, BaseException), (k, op, repr(outcome))
        step, got, last_load = outcome
        assert step in (5, 6), (k, op, step)
        _assert_loaded(step, got, last_load, step)
        loaded.add(step)
    assert loaded == {5, 6}


def test_loading_a_named_step_while_retention_deletes_it(base):
    outcomes = _race(base, 5)
    ops = [op for k, op, _ in outcomes[1:]]
    first_look = next(i for i, (name, where, _) in enumerate(ops) if name in ("list", "read") and where != ".")
    removed = 0
    for k, op, outcome in outcomes:
        if isinstance(outcome, BaseException) and k <= first_look:  # deleted before the load first looked
            assert type(outcome) is CheckpointNotFoundError and str(outcome).endswith("has no step 5"), repr(outcome)
        elif isinstance(outcome, BaseException):
            assert type(outcome) is CheckpointRemovedError, (k, op, repr(outcome))
            assert not isinstance(outcome, CheckpointCorruptError)
            assert "step 5 was removed while it was being loaded" in str(outcome), str(outcome)
            assert outcome.path.endswith(step_dir(5))
            removed += 1
        else:
            _assert_loaded(*outcome, 5)
    assert removed > 0


def test_a_step_that_never_existed_is_still_not_found(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(1, step_state(1))
    with pytest.raises(CheckpointNotFoundError, match=r"has no step 7$") as info:
        mgr.load(step_state(0), step=7)
    assert type(info.value) is CheckpointNotFoundError


def test_a_plain_load_of_a_directory_deleted_under_it_raises_only_checkpoint_errors(tmp_path):
    """`ckptlib.load` of a directory that another process deletes before each of its operations
    in turn: the load completes bit-exactly, or raises a CheckpointError naming the path (the
    manifest that vanished between listing and reading: CheckpointRemovedError), never a raw
    FileNotFoundError."""
    import ckptlib

    counter = iter(range(10**6))

    def make(at):
        path = str(tmp_path / f"c{next(counter)}")
        ckptlib.save(path, step_state(3))
        storage = Interleaved(path, at, lambda: LocalStorage(path).delete_tree())
        got = step_state(0)
        return storage, lambda: (ckptlib.load(storage, got), got)[1]

    kinds = set()
    for k, op, outcome in run_at_every_operation(make):
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, CheckpointError) and outcome.path, (k, op, repr(outcome))
            kinds.add(type(outcome).__name__)
        else:
            assert torch.equal(outcome["model"]["w"], step_state(3)["model"]["w"]), (k, op)
    assert "CheckpointRemovedError" in kinds, kinds
