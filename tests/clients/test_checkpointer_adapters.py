"""The adapters of other tools' checkpointers (ckptlib.testing.checkpointers: torchtitan,
lightning, accelerate; issue 48.2) against the real packages, gloo on CPU: a tiny FSDP2 MLP,
AdamW and a StepLR trained 2 steps and saved through the adapter at N ranks, then one more
step and saved again, then loaded at M (helpers/client_scripts/checkpointer_run.py). Model and
optimizer state are compared bit-exactly with the saved run's step 3; the step returned, the
state's "step" and "epoch" must be step 3's; the optimizer's param groups keep their keys. What a
package does not restore is asserted as it is (the findings of docs/conformance.md):

- torchtitan: restores the scheduler (through its `states`), not the per-rank RNG;
- Lightning's sharded load leaves the scheduler object fresh (it replaces the mapping's entry
  with the saved dict), so the adapter does not promise it; no per-rank RNG;
- Accelerate restores the scheduler and each saved rank's global RNG, but only on the ranks
  that existed at the save: a new rank keeps its own RNG.
"""

from __future__ import annotations

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients

VERSIONS = {"torchtitan": "0.3.0", "lightning": "2.6.6", "accelerate": "1.16.0"}  # ci/constraints-clients-hf.txt


def _files(adapter: str, world: int) -> list[str]:
    """What the adapter leaves under its root after saving steps 2 and 3 at `world` ranks."""
    shards = [f"__{r}_0.distcp" for r in range(world)]
    out = []
    for step in (2, 3):
        if adapter == "torchtitan":
            out += [f"checkpoint/step-{step}/{f}" for f in [".metadata", *shards]]
        elif adapter == "lightning":
            out += [f"step={step}.ckpt/{f}" for f in [".metadata", *shards, "meta.pt"]]
        else:
            folder = f"checkpoints/checkpoint_{step}"
            out += [f"{folder}/custom_checkpoint_0.pkl", f"{folder}/custom_checkpoint_1.pkl"]
            out += [
                f"{folder}/{part}/{f}"
                for part in ("optimizer_0", "pytorch_model_fsdp_0")
                for f in [".metadata", *shards]
            ]
            out += [f"{folder}/random_states_{r}.pkl" for r in range(world)]
    return sorted(out)


def _run(root, mode: str, adapter: str, nproc: int) -> list[dict]:
    return client_envs.run("hf", "checkpointer_run.py", mode, str(root), adapter, nproc=nproc, workdir=str(root))


@pytest.mark.parametrize("adapter", sorted(VERSIONS))
@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2)], ids=["save2-load1", "save1-load2"])
def test_adapter_saves_at_n_and_loads_at_m_bit_exactly(tmp_path, adapter, saved, loaded):
    (save,) = _run(tmp_path, "save", adapter, saved)[:1]
    assert save["version"] == VERSIONS[adapter]
    assert save["files"] == _files(adapter, saved)
    assert save["groups_unchanged"] is True  # the adapter leaves the optimizer's param groups as they were
    results = _run(tmp_path, "load", adapter, loaded)
    assert [r["world"] for r in results] == [loaded] * loaded
    for rank, got in enumerate(results):
        assert (got["step"], got["state_step"], got["state_epoch"]) == (3, 3, 2)  # the newest of steps 2 and 3
        assert (got["model"], got["optim"]) == ([], [])
        assert got["groups_unchanged"] is True
        assert got["sched_entry"] == "StepLR"  # the harness's object is still in the mapping
        if adapter == "lightning":
            assert got["carries"] == ["epoch", "model", "optim", "step"]
            assert (got["sched_restored"], got["sched_fresh"]) == (False, True)
        else:
            assert got["carries"] == ["epoch", "model", "optim", "sched", "step"]
            assert (got["sched_restored"], got["sched_fresh"]) == (True, False)
        # per-rank RNG: only Accelerate keeps it, and only for the ranks the save had
        assert got["rng_restored"] is (adapter == "accelerate" and rank < saved)


@pytest.mark.parametrize("adapter", sorted(VERSIONS))
def test_adapter_load_of_an_empty_root_is_a_fresh_start(tmp_path, adapter):
    (got,) = _run(tmp_path, "fresh", adapter, 1)
    assert (got["step"], got["state_step"]) == (None, -1)


def test_torchtitan_async_save_resumes_the_state_it_staged(tmp_path):
    """torchtitan's async_mode="async" through the adapter's async_save: training goes on while
    each save is in flight, and the load at another world size gets the state of the save call."""
    (save,) = _run(tmp_path, "save-async", "torchtitan", 2)[:1]
    assert (save["files"], save["groups_unchanged"]) == (_files("torchtitan", 2), True)
    (got,) = _run(tmp_path, "load", "torchtitan", 1)
    assert (got["step"], got["state_step"], got["state_epoch"]) == (3, 3, 2)
    assert (got["model"], got["optim"], got["sched_restored"]) == ([], [], True)
