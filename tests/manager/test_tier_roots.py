"""Every reader of a root agrees with the cluster tier about its newest step (issue 33):

- a node-local root keeps a `latest` naming its newest commit, so after a rollback (save 10,
  20, 30; load 20; save 25) a plain manager, `ckpt export ROOT` and `ckpt gc ROOT --keep-last
  1` take 25, never the abandoned 30, and gc keeps the step the tier resumes from;
- a root written by a plain manager (no commit records) and then used with `remote=` is
  ordered by its own `latest` first, not by the one-second `created` stamps (equal for saves
  within one second, where the highest step number won)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckptlib import CheckpointManager, Cluster
from ckptlib.storage import open_storage


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((16, 8), float(step))}, "step": step}


def _fresh() -> dict:
    return {"model": {"w": torch.zeros(16, 8)}, "step": -1}


def _ckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptlib.cli", *args], capture_output=True, text=True, timeout=240)


@pytest.fixture
def rolled_back(tmp_path) -> tuple[str, str]:
    """(node root, remote): steps 10, 20, 30 saved, 20 resumed, then 25 saved."""
    node, remote = str(tmp_path / "node"), str(tmp_path / "remote")
    mgr = CheckpointManager(node, cluster=Cluster(remote=remote))
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
        mgr.wait()
    assert mgr.load(_fresh(), step=20) == 20
    mgr.save(25, _state(25))
    assert mgr.wait().step == 25
    mgr.close()
    return node, remote


def test_the_node_root_names_its_newest_commit(rolled_back):
    node, remote = rolled_back
    assert open_storage(node).read_pointer("latest") == "step_0000000025"
    assert CheckpointManager(node).latest() == 25
    state = _fresh()
    assert CheckpointManager(node).load(state) == 25
    assert torch.equal(state["model"]["w"], _state(25)["model"]["w"])
    assert CheckpointManager(node, cluster=Cluster(remote=remote)).latest() == 25


def test_gc_of_the_node_root_keeps_the_step_the_tier_resumes(rolled_back):
    node, remote = rolled_back
    done = _ckpt("gc", node, "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    assert "step_0000000025" in os.listdir(node)
    state = _fresh()
    assert CheckpointManager(node, cluster=Cluster(remote=remote)).load(state) == 25
    assert torch.equal(state["model"]["w"], _state(25)["model"]["w"])


def test_export_and_inspect_of_the_node_root_read_the_newest_commit(rolled_back, tmp_path):
    node, _ = rolled_back
    done = _ckpt("inspect", node, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["root"]["step"] == 25 and doc["root"]["chosen"] == "latest", doc["root"]
    out = tmp_path / "export"
    done = _ckpt("export", node, str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(f"checkpoint root {node}: using step 25 (its latest)")
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    assert list(exported) == ["w"] and torch.equal(exported["w"], _state(25)["model"]["w"])  # the model alone


def test_a_plain_root_used_with_a_remote_is_ordered_by_its_latest(tmp_path):
    root, remote = str(tmp_path / "run"), str(tmp_path / "remote")
    plain = CheckpointManager(root)
    for step in (10, 20, 30):  # within one second: equal `created` stamps
        plain.save(step, _state(step))
    assert plain.load(_fresh(), step=20) == 20
    plain.save(25, _state(25))
    assert open_storage(root).read_pointer("latest") == "step_0000000025"
    for step in (10, 20, 25, 30):
        manifest = json.loads(open(os.path.join(root, f"step_{step:010d}", "ckptlib.json")).read())
        assert "commit" not in manifest  # a plain manager writes no commit records
    tiered = CheckpointManager(root, cluster=Cluster(remote=remote))
    state = _fresh()
    assert tiered.load(state) == 25
    assert torch.equal(state["model"]["w"], _state(25)["model"]["w"])
    tiered.wait()  # the resumed step is uploaded as the remote's latest, never the abandoned 30
    assert open_storage(remote).read_pointer("latest") == "step_0000000025"
    tiered.close()
