"""Roots written by ckptlib 0.1.0, before the 0.2 move (tests/fixtures/ckptlib_0.1_roots/, pinned):
0.2 reads every step of them bit-exactly, resumes the step their `latest` names, and goes on
saving into them. The on-disk format did not change with the packages."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import ckptlib
from ckptlib import Cluster, RemoteTier

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "ckptlib_0.1_roots")


@pytest.fixture
def roots(tmp_path):
    """A copy of the fixture (the tests write into the roots)."""
    copy = tmp_path / "roots"
    shutil.copytree(FIXTURE, copy, symlinks=True)
    return copy


def _reference(name: str) -> dict:
    return torch.load(os.path.join(FIXTURE, "reference.pt"), weights_only=True)[name]


def _fresh() -> dict:
    model = torch.nn.Linear(4, 3)
    torch.nn.init.zeros_(model.weight)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {
        "model": model,
        "optim": optim,
        "extra": {"step": torch.tensor(-1), "half": torch.zeros(5, dtype=torch.float16)},
    }


def _assert_is(state: dict, name: str) -> None:
    """`state` holds exactly the reference state of `name`: tensors bit-exact, dtypes equal."""
    want = _reference(name)
    got = {
        "model": state["model"].state_dict(),
        "optim": get_optimizer_state_dict(state["model"], state["optim"]),
        "extra": state["extra"],
    }

    def same(a, b, where):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
        elif isinstance(a, dict):
            assert sorted(a) == sorted(b), where
            for key in a:
                same(a[key], b[key], f"{where}.{key}")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, where

    same(want, got, name)


def test_a_plain_root_resumes_its_latest_step_and_reads_every_step(roots):
    mgr = ckptlib.CheckpointManager(roots / "single", keep_last=2)
    assert mgr.steps() == [2, 3] and mgr.latest() == 3
    state = _fresh()
    assert mgr.load(state) == 3
    _assert_is(state, "single/3")
    assert mgr.last_load.metrics == {"loss": pytest.approx(1 / 3)}
    older = _fresh()
    assert mgr.load(older, step=2) == 2
    _assert_is(older, "single/2")
    mgr.save(4, state)  # 0.2 goes on saving into a 0.1 root: retention keeps 3 and 4
    assert mgr.steps() == [3, 4] and mgr.latest() == 4
    mgr.close()


def test_a_cluster_root_resumes_locally_then_from_the_remote(roots):
    def manager():
        return ckptlib.CheckpointManager(
            roots / "node", keep_last=1, cluster=Cluster(remote=RemoteTier(str(roots / "remote"), keep_last=2))
        )

    mgr = manager()
    assert mgr.steps() == [4, 5] and mgr.local_steps() == [5]
    state = _fresh()
    assert mgr.load(state) == 5
    _assert_is(state, "cluster/5")
    assert mgr.last_load.bytes_by_source["remote"] == 0 and mgr.last_load.bytes_by_source["local"] > 0
    mgr.close()
    shutil.rmtree(roots / "node")  # a new machine: the node's disk is empty
    mgr = manager()
    again = _fresh()
    assert mgr.load(again) == 5
    _assert_is(again, "cluster/5")
    assert mgr.last_load.bytes_by_source["local"] == 0 and mgr.last_load.bytes_by_source["remote"] > 0
    mgr.close()


def test_a_step_loads_with_the_plain_load(roots):
    state = _fresh()
    result = ckptlib.load(str(roots / "remote" / "step_0000000004"), state)
    assert result.step == 4
    _assert_is(state, "cluster/4")
