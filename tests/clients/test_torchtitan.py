"""torchtitan 0.3.0 and ckptlib, both ways (issue 28.3, 28.5, 28.6): a tiny llama3 with fused QKV
(state-dict hooks), its OptimizersContainer (flat layout), schedulers and train state.

- torchtitan's own CheckpointManager saves at 2 ranks; `ckptlib.load(..., preset="torchtitan")`
  reads the newest step-N at 1 and 3 ranks bit-exactly (model at the top level, the flat
  optimizer paired with the model);
- `ckptlib.integrations.torchtitan.CheckpointManager` saves through ckptlib (committed step-N
  folders) and torchtitan's own manager resumes from them, and the other way round, at
  another world size.
"""

from __future__ import annotations

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients


def _run(root, *args, nproc):
    return client_envs.run("hf", "titan_run.py", args[0], str(root), *args[1:], nproc=nproc, workdir=str(root))


@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"save2-torchtitan-load{n}")
def test_torchtitan_checkpoint_loads_bit_exactly_through_the_preset(tmp_path, world_size):
    saved = _run(tmp_path, "save", "torchtitan", nproc=2)[0]
    assert saved["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for got in _run(tmp_path, "preset", "torchtitan", nproc=world_size):
        assert got["differences"] == []
        assert got["uri"] == "step-2" and got["step"] == 2
        assert got["metadata"]["train_state"] == {"step": 2, "ntokens_seen": 32}


@pytest.mark.parametrize(
    "saver, loader",
    [("ckptlib", "torchtitan"), ("torchtitan", "ckptlib"), ("ckptlib", "ckptlib")],
    ids=["save2-ckptlib-resume3-torchtitan", "save2-torchtitan-resume3-ckptlib", "save2-ckptlib-resume1-ckptlib"],
)
def test_ckptlib_checkpoint_manager_interoperates_with_torchtitans(tmp_path, saver, loader):
    saved = _run(tmp_path, "save", saver, nproc=2)[0]
    if saver == "ckptlib":
        assert "ckptlib.json" in saved["files"] and ".metadata" in saved["files"]
    world_size = 1 if saver == loader else 3
    for got in _run(tmp_path, "resume", loader, saver, nproc=world_size):
        assert got["loaded"] is True
        assert got["differences"] == []
        assert got["train_state"] == {"step": 2, "ntokens_seen": 32}
