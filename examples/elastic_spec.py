"""A training job described for `ckpt validate --spec` (a module of factory functions).

A plain PyTorch model trained with two optimizers (AdamW for the body, SGD with momentum for
the head), an LR scheduler on each (warmup then cosine decay; step decay), dropout (so the
per-rank RNG state matters: `ckptlib.RNGState`), and a data loader whose position survives a
resize (torchdata's StatefulDataLoader over `ckptlib.ElasticDistributedSampler`, restored with
`ckptlib.MergeSamplerProgress`). Prove that it resumes at any world size and layout:

    ckpt validate --spec examples/elastic_spec.py --world-sizes 1,2,3 --layouts fsdp2,ddp

or in a test: `ckptlib.testing.assert_elastic("examples/elastic_spec.py", world_sizes=(1, 2, 3))`.
Every factory is a module-level function: each rank imports this file and calls them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ckptlib

LAYOUTS = ("fsdp2", "ddp")  # what `ckpt validate --spec` runs when --layouts is not given
STEPS = 3  # training steps before the checkpoint

SAMPLES, FEATURES, CLASSES, BATCH = 48, 10, 4, 4


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 17), nn.GELU())
        self.norm = nn.LayerNorm(17)
        self.head = nn.Linear(17, CLASSES)  # 4 rows: FSDP2 at 3 ranks holds 2, 2 and 0 (a zero-size shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def build_model(seed: int) -> nn.Module:
    """A fresh, unwrapped model; the seed decides its weights."""
    torch.manual_seed(seed)
    return Classifier()


def fsdp_units(model: Classifier) -> list[nn.Module]:
    """Submodules that get their own FSDP unit under the fsdp2 and hsdp layouts."""
    return [model.body, model.head]


def build_optimizers(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    """Two optimizers over the parallelized model's parameters; saved as "body_opt" and "head_opt"."""
    body = [p for name, p in model.named_parameters() if "head." not in name]
    head = [p for name, p in model.named_parameters() if "head." in name]
    return {
        "body_opt": torch.optim.AdamW(body, lr=3e-3, weight_decay=0.05),
        "head_opt": torch.optim.SGD(head, lr=1e-2, momentum=0.9),
    }


def build_schedulers(optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    body, head = optimizers["body_opt"], optimizers["head_opt"]
    warmup = torch.optim.lr_scheduler.LinearLR(body, start_factor=0.2, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(body, T_max=10)
    return {
        "body_sched": torch.optim.lr_scheduler.SequentialLR(body, [warmup, cosine], milestones=[2]),
        "head_sched": torch.optim.lr_scheduler.StepLR(head, step_size=2, gamma=0.5),
    }


def _dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def build_state(rank: int, world_size: int) -> dict:
    """Per-rank state: this rank's RNGs and its data loader's position (merged over the saved
    ranks on a resize, so every sample of the epoch is still seen once)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = ckptlib.ElasticDistributedSampler(SAMPLES, world_size, rank, shuffle=True, seed=7)
    loader = StatefulDataLoader(_dataset(), batch_size=BATCH, sampler=sampler)
    return {
        "rng": ckptlib.RNGState(),
        "data": ckptlib.RankLocal(loader, policy=ckptlib.MergeSamplerProgress()),
    }


def train_step(training, step: int) -> None:
    """One step on this rank's next batch: both optimizers, then both schedulers."""
    x, y = training.next_batch("data")
    loss = F.cross_entropy(training.model(x), y)
    loss.backward()
    for opt in training.optimizers.values():
        opt.step()
        opt.zero_grad(set_to_none=True)
    for sched in training.schedulers.values():
        sched.step()
