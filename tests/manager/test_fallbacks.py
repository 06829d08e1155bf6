"""Paths that only warn and fall back: each asserts the warning *and* the choice it made.

A fallback that picks the wrong step still "works" (something loads), so a test that checks
only that a load succeeded cannot catch it: these check the step, the values and the words.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, StalePointerWarning
from ckptlib.testing.fakes.legacy_writers import write_v0


def _state(value: float) -> dict:
    return {"w": torch.full((3,), float(value)), "step": int(value)}


def _empty() -> dict:
    return {"w": torch.zeros(3), "step": -1}


def _saved(root, steps) -> CheckpointManager:
    mgr = CheckpointManager(root)
    for step in steps:
        mgr.save(step, _state(step))
    return mgr


def _point(root, target: str) -> None:
    link = os.path.join(root, "latest")
    os.remove(link)
    os.symlink(target, link)


def _uncommit(root, step: int) -> None:
    """A save of `step` that wrote its files but never its manifest."""
    os.remove(os.path.join(root, f"step_{step:010d}", "ckptlib.json"))


CASES = {
    # latest names an uncommitted step that is also the newest: the newest committed one is used
    "uncommitted-newest": ([2, 4, 6], lambda root: _uncommit(root, 6), "step_0000000006", 4),
    # latest names an uncommitted step in the middle: still the newest *committed* step, not the one before it
    "uncommitted-middle": (
        [2, 4, 6],
        lambda root: (_uncommit(root, 4), _point(root, "step_0000000004")),
        "step_0000000004",
        6,
    ),
    # latest names a step directory that does not exist at all
    "missing-target": ([3, 5], lambda root: _point(root, "step_0000000009"), "step_0000000009", 5),
    # latest names something that is not a step directory
    "not-a-step": ([3, 5], lambda root: _point(root, "elsewhere"), "elsewhere", 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stale_pointer_warns_and_names_the_step_it_uses(tmp_path, case):
    steps, damage, target, expected = CASES[case]
    root = str(tmp_path / "run")
    _saved(root, steps)
    damage(root)
    mgr = CheckpointManager(root)
    message = f"{root}/latest points to {target!r}, which is not a committed checkpoint; using step {expected}"
    with pytest.warns(StalePointerWarning) as record:
        assert mgr.latest() == expected
    assert [str(w.message) for w in record] == [message]
    state = _empty()
    with pytest.warns(StalePointerWarning, match="which is not a committed checkpoint"):
        assert mgr.load(state) == expected
    assert state["step"] == expected and torch.equal(state["w"], torch.full((3,), float(expected)))


def test_stale_pointer_with_nothing_committed_warns_and_loads_nothing(tmp_path):
    root = str(tmp_path / "run")
    _saved(root, [7])
    _uncommit(root, 7)
    mgr = CheckpointManager(root)
    with pytest.warns(StalePointerWarning) as record:
        assert mgr.latest() is None
    assert [str(w.message) for w in record] == [
        f"{root}/latest points to 'step_0000000007', which is not a committed checkpoint, and no committed step exists"
    ]


def test_a_valid_pointer_older_than_the_newest_step_is_followed_without_warning(tmp_path, recwarn):
    """A rollback: latest names step 2 although step 4 is committed. latest wins, silently."""
    root = str(tmp_path / "run")
    _saved(root, [2, 4])
    _point(root, "step_0000000002")
    mgr = CheckpointManager(root)
    state = _empty()
    assert mgr.latest() == 2 and mgr.load(state) == 2
    assert state["step"] == 2
    assert not [w for w in recwarn if issubclass(w.category, StalePointerWarning)]


@pytest.mark.parametrize("world_size", [11, 12, 23])
def test_v0_sets_of_more_than_ten_ranks_load_in_rank_order(tmp_path, world_size):
    """rank_10.pt must be rank 10, not the third file in name order: every rank holds a
    different, uneven slice, so any misordering moves rows."""
    g = torch.Generator().manual_seed(world_size)
    ref = {
        "model": {
            "w": torch.randn(3 * world_size + 5, 4, generator=g),
            "b": torch.arange(2 * world_size + 1, dtype=torch.int64),
        },
        "epoch": 3,
    }
    path = str(tmp_path / "v0")
    names = write_v0(path, ref, world_size)
    assert sorted(names) != names  # the name order really differs from the rank order
    state = {"model": {"w": torch.zeros_like(ref["model"]["w"]), "b": torch.zeros_like(ref["model"]["b"])}, "epoch": 0}
    result = ckptlib.load(path, state)
    assert result.format == "v0" and result.world_size == world_size
    assert torch.equal(state["model"]["w"], ref["model"]["w"])
    assert torch.equal(state["model"]["b"], ref["model"]["b"])
    assert state["epoch"] == 3
