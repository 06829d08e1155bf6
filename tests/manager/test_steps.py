"""Step numbers of any int64 size round-trip through naming, `latest`, `ls`, gc and retention.

Before: `step_dir` wrote 11 digits for steps >= 10^10 but the step regex matched exactly 10,
so the newest step was saved, pointed at by `latest` and then never seen again (load resumed
an older step, `ls` hid it, retention never deleted it).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, cli
from ckptlib.errors import StateError
from ckptlib.format.native.root import INT64_MAX, check_step, parse_step, step_dir

BIG = [10**10 - 1, 10**10, 10**10 + 7, 10**12, 10**18, INT64_MAX]


@pytest.mark.parametrize("step", [0, 1, 42, *BIG], ids=lambda s: f"step{s}")
def test_step_dir_round_trips(step):
    name = step_dir(step)
    assert parse_step(name) == step
    if step < 10**10:
        assert name == f"step_{step:010d}"  # the on-disk naming of every root written before
    else:
        assert name == f"step_{step}"


@pytest.mark.parametrize(
    "name",
    [
        "step_1",
        "step_00000000001",
        "step_009999999999",
        "step_9223372036854775808",
        "step_-000000001",
        "step_0000000001.tmp",
        "xstep_0000000001",
        "step_99999999999999999999",
    ],
)
def test_names_that_are_not_step_directories(name):
    assert parse_step(name) is None


@pytest.mark.parametrize(
    "bad",
    [-1, True, False, 1.0, 2.5, "3", b"3", None, INT64_MAX + 1, 10**30, np.float64(3.0)],
    ids=lambda v: f"{type(v).__name__}-{v!r}"[:40],
)
def test_bad_steps_are_state_errors(tmp_path, bad):
    with pytest.raises(StateError, match="step"):
        check_step(bad)
    mgr = CheckpointManager(tmp_path / "run")
    with pytest.raises(StateError, match="step"):
        mgr.save(bad, {"w": torch.zeros(2)})
    if bad is not None:
        with pytest.raises(StateError, match="step"):
            ckptlib.save(tmp_path / "one", {"w": torch.zeros(2)}, step=bad)
        with pytest.raises(StateError, match="step"):
            mgr.load({"w": torch.zeros(2)}, bad)
    assert not (tmp_path / "one").exists() and not (tmp_path / "run").exists()


def test_numpy_integer_steps_are_steps(tmp_path):
    mgr = CheckpointManager(tmp_path / "run")
    mgr.save(np.int64(10**11), {"w": torch.ones(2)})
    assert mgr.steps() == [10**11] and isinstance(mgr.steps()[0], int)


def test_big_steps_round_trip_through_latest_load_ls_and_retention(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=3)
    steps = [9_999_999_998, 9_999_999_999, 10**10, 10**10 + 1, 123_456_789_012, INT64_MAX]
    for step in steps:
        mgr.save(step, {"w": torch.full((3,), float(step % 997)), "step": step})
        assert mgr.latest() == step
        state = {"w": torch.zeros(3), "step": -1}
        assert mgr.load(state) == step
        assert state["step"] == step and torch.equal(state["w"], torch.full((3,), float(step % 997)))
    assert mgr.steps() == steps[-3:]  # sorted numerically, retention kept the newest three
    assert sorted(os.listdir(root)) == sorted(["latest", *(step_dir(s) for s in steps[-3:])])
    assert os.readlink(root / "latest") == f"step_{INT64_MAX}"

    assert cli.main(["ls", "--json", str(root)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in listed["steps"]] == steps[-3:]
    assert [r["latest"] for r in listed["steps"]] == [False, False, True]
    assert cli.main(["ls", str(root)]) == 0
    assert str(INT64_MAX) in capsys.readouterr().out

    assert cli.main(["gc", "--keep", "1", str(root)]) == 0
    capsys.readouterr()
    assert mgr.steps() == [INT64_MAX]
    assert sorted(os.listdir(root)) == ["latest", f"step_{INT64_MAX}"]


def test_big_step_debris_is_collected(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(10**10, {"w": torch.ones(2)})
    debris = root / step_dir(10**11)
    debris.mkdir()
    (debris / "ckptlib.pending").write_text("{}")
    (debris / "__0_0.distcp").write_bytes(b"half")
    assert mgr.latest() == 10**10
    mgr.save(10**12, {"w": torch.ones(2)})
    assert sorted(os.listdir(root)) == ["latest", step_dir(10**10), step_dir(10**12)]


def test_lookalike_directories_are_left_alone(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    (root / "step_42").mkdir(parents=True)
    (root / "step_42" / "notes.txt").write_text("mine")
    for step in (1, 2):
        mgr.save(step, {"w": torch.ones(2)})
    assert (root / "step_42" / "notes.txt").read_text() == "mine"
    assert mgr.steps() == [2]
