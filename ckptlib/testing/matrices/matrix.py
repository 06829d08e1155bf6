"""The elastic round trip: train and save at N ranks, load at M, prove the state is identical.

Shared by the pytest matrix (`tests/elastic/test_elastic.py`) and `ckpt validate`. Every function
here runs inside a rank of an initialized process group (or a group passed explicitly).
The model has odd dims (uneven shards), a layer with fewer rows than ranks (zero-size
shards), a bias-free layer, a LayerNorm and a buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptlib._torch import parallel

WRAPPINGS = ("fsdp2", "ddp", "plain")
OPTIMIZERS = ("adam", "adamw", "sgd")
IN_DIM, HIDDEN, OUT_DIM = 33, 65, 3


@dataclasses.dataclass(frozen=True)
class Case:
    save_ws: int
    load_ws: int
    wrap: str = "fsdp2"
    optim: str = "adamw"

    @property
    def id(self) -> str:
        return f"save{self.save_ws}-load{self.load_ws}-{self.wrap}-{self.optim}"


class MatrixNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_DIM, HIDDEN)  # 65x33: uneven on 2, 3 and 4 ranks
        self.norm = nn.LayerNorm(HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_DIM, bias=False)  # 3 rows: a zero-size shard on 4 ranks
        self.register_buffer("scale", torch.ones(HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.inp(x))) * self.scale)


def build_model(seed: int) -> MatrixNet:
    torch.manual_seed(seed)
    model = MatrixNet()
    with torch.no_grad():
        model.scale.copy_(torch.rand(HIDDEN) + 0.5)
    return model


def wrap_model(model: nn.Module, wrap: str, group=None) -> nn.Module:
    if wrap == "plain":
        return model
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=group)
    if wrap == "fsdp2":
        fully_shard = parallel.require_fsdp2_cpu()
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if group is None:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        else:
            mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (model.inp, model.norm, model.out):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    raise ValueError(f"unknown wrapping {wrap!r}; choose from {WRAPPINGS}")


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}; choose from {OPTIMIZERS}")


def batch(step: int) -> torch.Tensor:
    """The same batch on every rank and at every world size."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, IN_DIM, generator=gen)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    loss = model(batch(step)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded model and optimizer state on every rank, as CPU tensors (collective)."""
    options = StateDictOptions(full_state_dict=True)
    msd = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=options).items()}
    osd = get_optimizer_state_dict(model, optim, options=options)
    return {"model": msd, "optim": _to_cpu(osd)}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Every place where two nested states differ (bit-exact for tensors)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: expected a tensor, got {type(actual).__name__}"]
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return [f"{path}: {expected.dtype}{tuple(expected.shape)} vs {actual.dtype}{tuple(actual.shape)}"]
        if not torch.equal(expected, actual):
            return [
                f"{path}: values differ (max abs diff {(expected.double() - actual.double()).abs().max().item():.3g})"
            ]
        return []
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: expected a dict, got {type(actual).__name__}"]
        out = [f"{path}.{k}: missing" for k in expected if k not in actual]
        out += [f"{path}.{k}: unexpected" for k in actual if k not in expected]
        for k in expected:
            if k in actual:
                out += differences(expected[k], actual[k], f"{path}.{k}")
        return out
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return [f"{path}: {expected!r} vs {actual!r}"]
        out = []
        for i, (a, b) in enumerate(zip(expected, actual)):
            out += differences(a, b, f"{path}[{i}]")
        return out
    return [] if expected == actual else [f"{path}: {expected!r} vs {actual!r}"]


def setup(case_wrap: str, optim: str, seed: int, group=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = wrap_model(build_model(seed), case_wrap, group)
    return model, make_optimizer(optim, model.parameters())


def save_side(uri: str, wrap: str, optim: str, *, steps: int = 2, group=None, manager: bool = False) -> dict[str, Any]:
    """Train `steps` steps at this world size, save to `uri`; return the full saved state."""
    import ckptlib

    model, opt = setup(wrap, optim, seed=0, group=group)
    for step in range(steps):
        train_step(model, opt, step)
    state = {"model": model, "optim": opt, "step": steps}
    if manager:
        ckptlib.CheckpointManager(uri, process_group=group).save(steps, state)
    else:
        ckptlib.save(uri, state, step=steps, metadata={"wrap": wrap}, process_group=group)
    return full_state(model, opt)


def load_side(
    uri: str, wrap: str, optim: str, expected: dict[str, Any], *, steps: int = 2, group=None, manager: bool = False
) -> list[str]:
    """Load at this world size; compare with `expected`; then train one step and compare with
    a run that reached the same state without a checkpoint. Returns the differences."""
    import ckptlib

    model, opt = setup(wrap, optim, seed=1, group=group)
    state = {"model": model, "optim": opt, "step": -1}
    if manager:
        loaded_step = ckptlib.CheckpointManager(uri, process_group=group).load(state)
    else:
        loaded_step = ckptlib.load(uri, state, process_group=group).step
    problems = [] if loaded_step == steps else [f"step: loaded {loaded_step}, expected {steps}"]
    if state["step"] != steps:
        problems.append(f"state['step']: {state['step']!r}, expected {steps}")
    problems += differences(expected, full_state(model, opt), "after-load")

    train_step(model, opt, steps)
    resumed = full_state(model, opt)

    ref_model, ref_opt = setup(wrap, optim, seed=2, group=group)
    options = StateDictOptions(full_state_dict=True)
    # set_*_state_dict replace entries of the dict they get (with DTensors): hand them copies.
    set_model_state_dict(ref_model, _to_cpu(expected["model"]), options=options)
    set_optimizer_state_dict(ref_model, ref_opt, _to_cpu(expected["optim"]), options=options)
    train_step(ref_model, ref_opt, steps)
    problems += differences(full_state(ref_model, ref_opt), resumed, "train-after-load")
    return problems
