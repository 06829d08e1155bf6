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


def checkpointer_of(checkpointer: Any, manager: bool, metadata: dict[str, Any] | None = None) -> Any:
    """The checkpointer a side saves and loads through: `checkpointer` when given, else ckptlib's
    manager (`manager=True`) or one ``ckptlib.save`` checkpoint at the URI."""
    if checkpointer is not None:
        return checkpointer
    from ckptlib.testing.checkpointers.ckptlib_adapter import CkptlibCheckpointer, SingleCheckpoint

    return CkptlibCheckpointer() if manager else SingleCheckpoint(metadata)


class Problems(list):
    """A load side's differences (a list of strings), with the state entries its checkpointer
    does not carry (`not_carried`: not compared, and the reference run takes them from the
    loaded run instead of from the save)."""

    def __init__(self, items=(), not_carried: Any = ()):
        super().__init__(items)
        self.not_carried = tuple(sorted(not_carried))


def step_problems(loaded_step: Any, state: dict, carries: Any, steps: int) -> Problems:
    """A load side's first check: the step the checkpointer resumed, and `state["step"]` where it
    carries that entry, are both `steps`; the entries it does not carry are noted."""
    state_step = state["step"] if "step" in carries else steps
    ok = loaded_step == steps and state_step == steps
    return Problems(
        [] if ok else [f"step: loaded {loaded_step}, state['step'] {state['step']!r}, expected {steps}"],
        set(state) - carries,
    )


#: The order in which a pair reports differences: the step, then one rank's own shard or
#: per-rank state, then the unsharded state, then the step trained after the load.
KINDS = ("load at", "save at", "step", "state['step']", "after-load.shard.", "after-load.rank", "after-load.")


def problem_kind(text: str) -> int:
    """Where `text` (one difference) stands in `KINDS` (after them all when it matches none)."""
    return next((i for i, prefix in enumerate(KINDS) if text.startswith(prefix)), len(KINDS))


def _local(value: Any) -> Any:
    """This rank's part of a tensor: a DTensor's local tensor, a ShardedTensor's local shards."""
    if type(value).__name__ == "ShardedTensor":
        return [shard.tensor.detach().cpu().clone() for shard in value.local_shards()]
    if hasattr(value, "to_local"):
        return value.to_local().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def local_state(model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], names: Any = None) -> dict[str, Any]:
    """This rank's shards of the model ("model") and of each optimizer's state (by name), as
    CPU tensors; only the entries in `names` when given. Not a collective beyond what
    ``get_*_state_dict`` of a sharded state needs (the same calls on every rank)."""
    out: dict[str, Any] = {}
    if names is None or "model" in names:
        out["model"] = _local(get_model_state_dict(model))
    for name, optim in optimizers.items():
        if names is None or name in names:
            osd = _local(get_optimizer_state_dict(model, optim))
            for group in osd.get("param_groups", []):
                group["params"] = sorted(group["params"])
            out[name] = osd
    return out


def save_through(cp: Any, uri: str, step: int, state: dict[str, Any], group=None) -> None:
    """`cp`'s save on every rank of `group`; raised on one rank, raised on all (naming it), so
    no rank goes on into a collective the others left."""
    from ckptlib._runtime import agree
    from ckptlib.testing.checkpointers.protocol import save_on

    agree.agree(lambda: save_on(cp, uri, step, state, group), group)


def load_through(cp: Any, uri: str, state: dict[str, Any], group=None) -> Any:
    """`cp`'s load on every rank of `group` (the step it returned), as `save_through`."""
    from ckptlib._runtime import agree
    from ckptlib.testing.checkpointers.protocol import load_on

    return agree.agree(lambda: load_on(cp, uri, state, group), group)


def only(state: dict[str, Any], names: Any) -> dict[str, Any]:
    """The entries of `state` named in `names`."""
    return {k: v for k, v in state.items() if k in names}


def save_side(
    uri: str,
    wrap: str,
    optim: str,
    *,
    steps: int = 2,
    group=None,
    manager: bool = False,
    checkpointer: Any = None,
) -> dict[str, Any]:
    """Train `steps` steps at this world size, save to `uri` through `checkpointer` (default:
    ckptlib, see `checkpointer_of`); return the full saved state."""
    model, opt = setup(wrap, optim, seed=0, group=group)
    for step in range(steps):
        train_step(model, opt, step)
    state = {"model": model, "optim": opt, "step": steps}
    save_through(checkpointer_of(checkpointer, manager, {"wrap": wrap}), uri, steps, state, group)
    return full_state(model, opt)


def load_side(
    uri: str,
    wrap: str,
    optim: str,
    expected: dict[str, Any],
    *,
    steps: int = 2,
    group=None,
    manager: bool = False,
    checkpointer: Any = None,
) -> Problems:
    """Load at this world size through `checkpointer`; compare what it carries with `expected`
    (the unsharded state, and this rank's shards against a never-checkpointed run's); then train
    one step and compare with that run. Returns the differences."""
    from ckptlib.testing.checkpointers.protocol import carried

    cp = checkpointer_of(checkpointer, manager)
    model, opt = setup(wrap, optim, seed=1, group=group)
    state = {"model": model, "optim": opt, "step": -1}
    carries = carried(cp, state)
    loaded_step = load_through(cp, uri, state, group)
    problems = Problems([] if loaded_step == steps else [f"step: loaded {loaded_step}, expected {steps}"])
    problems.not_carried = tuple(sorted(set(state) - carries))
    if "step" in carries and state["step"] != steps:
        problems.append(f"state['step']: {state['step']!r}, expected {steps}")
    shards = local_state(model, {"optim": opt}, carries)
    loaded = full_state(model, opt)
    problems += differences(only(expected, carries), only(loaded, carries), "after-load")

    train_step(model, opt, steps)
    resumed = full_state(model, opt)

    ref_model, ref_opt = setup(wrap, optim, seed=2, group=group)
    options = StateDictOptions(full_state_dict=True)
    start = {k: expected[k] if k in carries else loaded[k] for k in ("model", "optim")}
    # set_*_state_dict replace entries of the dict they get (with DTensors): hand them copies.
    set_model_state_dict(ref_model, _to_cpu(start["model"]), options=options)
    set_optimizer_state_dict(ref_model, ref_opt, _to_cpu(start["optim"]), options=options)
    problems += differences(local_state(ref_model, {"optim": ref_opt}, carries), shards, "after-load.shard")
    train_step(ref_model, ref_opt, steps)
    problems += differences(full_state(ref_model, ref_opt), resumed, "train-after-load")
    return problems
