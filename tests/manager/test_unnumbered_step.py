"""A step directory written without `step=` (seeded by `ckpt convert ... root/step_N`, or by
`ckptlib.save(root/step_N, state)`): `CheckpointManager.load()` resumes from it and returns N,
never None ("nothing to resume", which restarted the loop at step 1 on loaded weights), and
`last_load.step` says N too.

Before: load() returned the manifest's step, which such a directory does not have: None.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, Cluster, RemoteTier
from ckptlib.cli import main as cli_main
from ckptlib.format.native.root import step_dir

STEPS = [5, 9_999_999_999, 10_000_000_000, 12_345_678_901]


@pytest.mark.parametrize("step", STEPS, ids=lambda s: f"step{s}")
@pytest.mark.parametrize("seeded_by", ["ckpt-convert", "save-without-step"])
def test_load_returns_the_directory_step_when_the_manifest_has_none(tmp_path, step, seeded_by):
    root = tmp_path / "run"
    weights = torch.nn.Linear(3, 2).state_dict()
    target = root / step_dir(step)
    if seeded_by == "ckpt-convert":
        torch.save(weights, tmp_path / "m.pt")
        assert cli_main(["convert", str(tmp_path / "m.pt"), str(target), "--to", "dcp", "--no-progress"]) == 0
    else:
        os.makedirs(root)
        ckptlib.save(target, {"model": weights})
    mgr = CheckpointManager(root)
    assert mgr.latest() == step
    model = torch.nn.Linear(3, 2)
    assert mgr.load({"model": model}) == step
    assert mgr.last_load.step == step and mgr.last_load.uri.endswith(step_dir(step))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert not mgr.maybe_save(step, {"model": model}, force=True)  # the step it resumed from is not saved again
    assert mgr.load({"model": torch.nn.Linear(3, 2)}, step=step) == step  # a named step too
    mgr.save(step + 1, {"model": model})
    assert mgr.steps() == [step, step + 1] and mgr.latest() == step + 1


def test_a_tiered_manager_returns_the_directory_step_too(tmp_path):
    remote = tmp_path / "remote"
    os.makedirs(remote)
    weights = torch.nn.Linear(3, 2).state_dict()
    ckptlib.save(remote / step_dir(7), {"model": weights})  # seeded without step=
    with CheckpointManager(
        str(tmp_path / "local"), keep_last=1, cluster=Cluster(remote=RemoteTier(str(remote)))
    ) as mgr:
        model = torch.nn.Linear(3, 2)
        assert mgr.load({"model": model}) == 7 and mgr.last_load.step == 7
        assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
