"""Steps on both sides of 10^10 (`step_9999999999` sorts after `step_10000000000` as text) with
the `latest` pointer missing, dangling, naming an uncommitted step or holding garbage: the
manager resumes the numerically newest committed step, bit-exactly, lists the steps in numeric
order, keeps the numerically newest under retention, and the next save moves `latest` on. On
local disk and on S3 (whose listings come in text order).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from ckptlib import CheckpointManager, StalePointerWarning, cli
from ckptlib.format.native.root import step_dir

STEPS = [9_999_999_998, 9_999_999_999, 10**10, 10**10 + 1]
POINTERS = ["missing", "dangling", "uncommitted", "garbage", "older"]


def _weights(step: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float64) + step


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def root(request, tmp_path) -> str:
    return str(tmp_path / "run") if request.param == "local" else request.getfixturevalue("s3_root")


def _spoil(mgr: CheckpointManager, pointer: str) -> int:
    """Spoil `latest` as `pointer` says; returns the step a resume must load."""
    store = mgr.storage
    store.delete(["latest"])
    if pointer == "dangling":
        store.set_pointer("latest", step_dir(10**11))
    elif pointer == "uncommitted":  # the newest save crashed before its commit; latest moved anyway
        store.child(step_dir(STEPS[-1])).delete(["ckptlib.json"])
        store.set_pointer("latest", step_dir(STEPS[-1]))
        return STEPS[-2]
    elif pointer == "garbage":
        store.set_pointer("latest", "step_")
    elif pointer == "older":  # a crash after the newest commit, before the pointer moved
        store.set_pointer("latest", step_dir(STEPS[1]))
        return STEPS[1]
    return STEPS[-1]


@pytest.mark.parametrize("pointer", POINTERS)
def test_resume_across_ten_to_the_ten_with_a_spoiled_latest(root, capsys, pointer):
    mgr = CheckpointManager(root, keep_last=10)
    for step in STEPS:
        mgr.save(step, {"w": _weights(step)})
    expected = _spoil(mgr, pointer)
    committed = [s for s in STEPS if pointer != "uncommitted" or s != STEPS[-1]]

    resumed = CheckpointManager(root, keep_last=2)
    state = {"w": torch.zeros(4, dtype=torch.float64)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resumed.steps() == committed
        assert resumed.latest() == expected
        assert resumed.load(state) == expected
    assert torch.equal(state["w"], _weights(expected))
    stale = [w for w in caught if issubclass(w.category, StalePointerWarning)]
    assert bool(stale) == (pointer in ("dangling", "uncommitted", "garbage"))

    assert cli.main(["ls", "--json", root]) == 0
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert [r["step"] for r in listed] == STEPS  # numeric order; the uncommitted one listed as such
    named = {"uncommitted": STEPS[-1], "older": STEPS[1]}.get(pointer)  # what the pointer names, if a step
    assert [r["step"] for r in listed if r["latest"]] == ([named] if named else [])

    nxt = 10**10 + 2
    resumed.save(nxt, {"w": _weights(nxt)})
    assert resumed.latest() == nxt
    assert resumed.steps() == [committed[-1], nxt]  # retention kept the numerically newest two
    state = {"w": torch.zeros(4, dtype=torch.float64)}
    assert CheckpointManager(root).load(state) == nxt and torch.equal(state["w"], _weights(nxt))
