"""What the real packages cannot do, asserted as they behave (issue 48.2; docs/conformance.md
links each to its reproduction under examples/conformance/, which these tests run as is):

- torchtitan 0.3.0 refuses to load its data loader at another DP size: an AssertionError on a
  smaller one, a missing ``dataloader.dp_rank_<r>`` key on every rank at a larger one;
- Lightning 2.6.6: a sharded (FSDP2) checkpoint's load replaces a stateful entry of the mapping
  with the saved dict and leaves the object fresh, where the full-file load restores it; its
  FSDP1 ``FSDPStrategy`` does not start on CPU;
- Accelerate 1.16.0 ignores an FSDP plugin on CPU: DDP, and whole-model files from rank 0.
"""

from __future__ import annotations

import os

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients

EXAMPLES = os.path.join(client_envs.REPO, "examples", "conformance")


def _run(root, script: str, *args: str, nproc: int) -> list[dict]:
    return client_envs.run("hf", os.path.join(EXAMPLES, script), *args, nproc=nproc, workdir=str(root))


@pytest.fixture(scope="module")
def titan_saved_at_2(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan-dataloader")
    assert (
        _run(root, "torchtitan_dataloader_resize.py", "save", str(root), nproc=2) == [{"saved": True, "world": 2}] * 2
    )
    return root


@pytest.mark.parametrize(
    "world, expected",
    [
        (2, {"loaded": True}),
        (
            1,
            {
                "error": "AssertionError",
                "message": "dp_degree is inconsistent before and after checkpoint, "
                "dataloader resharding is not supported yet.",
            },
        ),
        (
            3,
            {
                "error": "CheckpointException",
                "message": "RuntimeError: Missing key in checkpoint state_dict: dataloader.dp_rank_2.",
            },
        ),
    ],
    ids=["save2-load2-resumes", "save2-load1-asserts", "save2-load3-missing-key"],
)
def test_torchtitan_refuses_its_data_loader_at_another_dp_size(titan_saved_at_2, world, expected):
    got = _run(titan_saved_at_2, "torchtitan_dataloader_resize.py", "load", str(titan_saved_at_2), nproc=world)
    assert got == [{**expected, "world": world}] * world


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("sharded", {"entry_after_load": "dict", "entry_is_saved_state": True, "scheduler_restored": False}),
        ("full", {"entry_after_load": "StepLR", "entry_is_saved_state": False, "scheduler_restored": True}),
        (
            "fsdp",
            {
                "error": "ValueError",
                "message": "You selected the FSDP strategy but FSDP is only available on GPU. "
                "Set `Fabric(accelerator='gpu', ...)` to continue or select a different strategy.",
            },
        ),
    ],
    ids=["sharded-leaves-the-scheduler-fresh", "full-restores-it", "fsdp1-refuses-cpu"],
)
def test_lightning_sharded_load_does_not_restore_stateful_objects(tmp_path, mode, expected):
    got = _run(tmp_path, "lightning_sharded_stateful.py", mode, str(tmp_path), nproc=2)
    assert got == [{**expected, "world": 2}] * 2


def test_accelerate_ignores_the_fsdp_plugin_on_cpu(tmp_path):
    got = _run(tmp_path, "accelerate_cpu_fsdp.py", str(tmp_path), nproc=2)
    files = ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"]
    expected = {"distributed_type": "DistributedType.MULTI_CPU", "model": "DistributedDataParallel", "files": files}
    assert got == [{**expected, "world": 2}] * 2
