"""PyTorch Lightning 2.6.6 and ckptlib, both ways (issue 28.3, 28.5, 28.6). Under torchrun:

lightning_run.py fit ROOT STRATEGY STEPS [CKPT]   train to STEPS with STRATEGY (lightning-mp: Lightning's own
    ModelParallelStrategy; ckptlib-mp / ckptlib-ddp: ckptlib.integrations.lightning's), ModelCheckpoint every 2
    steps into ROOT/STRATEGY-wsN; with CKPT, resume from it first (fit(ckpt_path=CKPT)) and report the state
    at train start against ROOT/expected.pt. Rank 0 writes the final full state to ROOT/expected.pt.
lightning_run.py load ROOT CKPT                   a plain FSDP2 model and AdamW load CKPT with preset="lightning"
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
from client_common import differences, finish, full_state, init_gloo, rank, report, world
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptlib
from ckptlib.integrations import lightning as ckptlib_lightning

warnings.filterwarnings("ignore")


class Tiny(L.LightningModule):
    def __init__(self, shard: bool = True):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self):
        if not self.hparams.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def strategy(name: str, ws: int):
    if name == "lightning-mp":
        return ModelParallelStrategy(data_parallel_size=ws, tensor_parallel_size=1)
    if name == "ckptlib-mp":
        return ckptlib_lightning.ModelParallelStrategy(data_parallel_size=ws, tensor_parallel_size=1)
    return ckptlib_lightning.DDPStrategy(process_group_backend="gloo")


class Probe(L.Callback):
    """The state a resumed run starts from (only when resuming: on a fresh optimizer, reading its
    state dict would initialise it, a step of its own)."""

    def __init__(self, resuming: bool):
        self.resuming = resuming
        self.seen = None

    def on_train_start(self, trainer, pl_module):
        if self.resuming:
            self.seen = (trainer.global_step, full_state(pl_module, trainer.optimizers[0]))


def fit(root: str, name: str, steps: int, ckpt: str | None) -> None:
    ws = int(os.environ.get("WORLD_SIZE", 1))
    probe = Probe(resuming=ckpt is not None)
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(root, f"{name}-ws{ws}"), every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ws,
        strategy=strategy(name, ws),
        max_steps=steps,
        callbacks=[checkpoints, probe],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Tiny(shard=name.endswith("-mp"))
    trainer.fit(module, data(), ckpt_path=ckpt)
    out = {"global_step": trainer.global_step, "world": world()}
    expected_path = os.path.join(root, "expected.pt")
    if ckpt is not None:
        step, state = probe.seen
        out.update(resumed_step=step, differences=differences(torch.load(expected_path, weights_only=True), state))
    final = full_state(trainer.lightning_module, trainer.optimizers[0])
    if rank() == 0 and ckpt is None:
        torch.save(final, expected_path)
    out["files"] = sorted(os.listdir(checkpoints.dirpath)) if rank() == 0 else []
    report(**out)


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def load(root: str, ckpt: str) -> None:
    init_gloo()
    model = Holder()
    if world() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world(),))
        for layer in model.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model.net, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    result = ckptlib.load(ckpt, {"model": model, "optim": optim}, preset="lightning")
    expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
    report(
        differences=differences(expected, full_state(model, optim)),
        step=result.step,
        epoch=result.metadata.get("epoch"),
        meta_keys=sorted(result.metadata),
        world=world(),
    )
    finish()


if __name__ == "__main__":
    if sys.argv[1] == "fit":
        fit(os.path.abspath(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else None)
    else:
        load(os.path.abspath(sys.argv[2]), sys.argv[3])
