"""PyTorch Lightning 2.6.6 and ckptlib, both ways (issue 28.3, 28.5, 28.6):

- Lightning's own ModelParallelStrategy checkpoints (FSDP2, saved at 2 ranks) load bit-exactly
  at 1 and 3 ranks through `preset="lightning"`, with meta.pt's progress in the LoadResult;
- `Trainer(strategy=ckptlib.integrations.lightning.ModelParallelStrategy(...))` saves through
  ckptlib and resumes at another world size (elastic), bit-exactly, and so does its
  DDPStrategy into the sharded strategy; Lightning's own strategy resumes from ckptlib's
  checkpoints (the same layout).
"""

from __future__ import annotations

import os

import pytest
from helpers import client_envs

pytestmark = pytest.mark.clients


def _fit(root, strategy, world_size, steps, ckpt=None):
    args = ["fit", str(root), strategy, str(steps)] + ([ckpt] if ckpt else [])
    return client_envs.run("hf", "lightning_run.py", *args, nproc=world_size, workdir=str(root))


@pytest.fixture(scope="module")
def lightning_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    first = _fit(root, "lightning-mp", 2, 4)[0]
    assert first["global_step"] == 4
    assert first["files"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    return root


@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"save2-lightning-load{n}")
def test_lightning_checkpoint_loads_bit_exactly_through_the_preset(lightning_root, world_size):
    ckpt = os.path.join(lightning_root, "lightning-mp-ws2", "epoch=0-step=4.ckpt")
    results = client_envs.run(
        "hf", "lightning_run.py", "load", str(lightning_root), ckpt, nproc=world_size, workdir=str(lightning_root)
    )
    for got in results:
        assert got["differences"] == []
        assert got["step"] == 4 and got["epoch"] == 0
        assert {"global_step", "loops", "callbacks", "lr_schedulers", "pytorch-lightning_version"} <= set(
            got["meta_keys"]
        )


@pytest.mark.parametrize(
    "save, resume",
    [
        (("ckptlib-mp", 2), ("ckptlib-mp", 3)),
        (("ckptlib-mp", 2), ("lightning-mp", 1)),
        (("ckptlib-ddp", 2), ("ckptlib-mp", 3)),
    ],
    ids=[
        "save2-ckptlib-mp-resume3-ckptlib-mp",
        "save2-ckptlib-mp-resume1-lightning-mp",
        "save2-ckptlib-ddp-resume3-ckptlib-mp",
    ],
)
def test_ckptlib_strategies_save_and_resume_elastically(tmp_path, save, resume):
    (name, ws) = save
    first = _fit(tmp_path, name, ws, 4)[0]
    assert first["files"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    last = tmp_path / f"{name}-ws{ws}" / "last.ckpt"
    assert (last / "ckptlib.json").is_file() and (last / "meta.pt").is_file()  # committed by ckptlib, Lightning's meta
    for got in _fit(tmp_path, resume[0], resume[1], 6, str(last)):
        assert got["resumed_step"] == 4
        assert got["differences"] == []
        assert got["global_step"] == 6
