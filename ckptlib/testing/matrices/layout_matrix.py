"""The layout round trip: train and save at layout A on N ranks, load at layout B on M ranks.

Shared by the pytest layout matrix (`tests/elastic/test_layouts.py`), `ckpt validate --layouts`
and users' own tests (any model: pass a :class:`ModelSpec`). Each load checks the full
model and optimizer state bit-exactly against the state at save time, then trains one
more step and compares with a run that reached the same state without a checkpoint.

Case selections: :func:`full_product` (every saved (layout, world size) loaded at every
(layout, world size)) and :func:`covering_subset` (every (save layout, load layout) pair
once, world sizes rotated so every layout is saved and loaded at each of its sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptlib._torch import parallel
from ckptlib.testing.matrices import matrix
from ckptlib.testing.matrices import parallel_layouts as lay
from ckptlib.testing.matrices.models import build_transformer, transformer_loss


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the round trip needs to know about a model (module-level functions: they
    are pickled to the ranks).

    - ``build(seed) -> nn.Module``: a fresh, unwrapped model; different seeds must give
      different weights (the load side starts from another seed).
    - ``loss(model, step) -> Tensor``: the loss of one training step (same data on every rank).
    - ``fsdp_units`` / ``tp_plan`` / ``after_tp``: functions of the unwrapped model; when
      None the model's own methods of those names are used (see ``layouts.apply_layout``).
    - ``optimizer(params, kind) -> Optimizer``; default ``matrix.make_optimizer``.
    """

    build: Callable[[int], nn.Module] = build_transformer
    loss: Callable[[nn.Module, int], torch.Tensor] = transformer_loss
    fsdp_units: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    tp_plan: Callable[[nn.Module], dict] | None = None
    after_tp: Callable[[nn.Module], None] | None = None
    optimizer: Callable[[Any, str], torch.optim.Optimizer] | None = None


TRANSFORMER = ModelSpec()


@dataclasses.dataclass(frozen=True)
class LayoutCase:
    save_ws: int
    save_layout: str
    load_ws: int
    load_layout: str
    optim: str = "adamw"

    @property
    def id(self) -> str:
        return f"save{self.save_ws}-{self.save_layout}-load{self.load_ws}-{self.load_layout}-{self.optim}"


def configs(layouts: Sequence[str], world_sizes: Sequence[int] | None = None) -> list[tuple[str, int]]:
    """(layout, world size) for every layout at its matrix sizes (or those of `world_sizes` it supports)."""
    out = []
    for name in layouts:
        layout = lay.get_layout(name)
        sizes = layout.matrix_sizes if world_sizes is None else [n for n in world_sizes if layout.supports(n)]
        out += [(name, n) for n in sizes]
    return out


def full_product(
    layouts: Sequence[str], world_sizes: Sequence[int] | None = None, optim: str = "adamw"
) -> list[LayoutCase]:
    every = configs(layouts, world_sizes)
    return [LayoutCase(n, a, m, b, optim) for a, n in every for b, m in every]


def covering_subset(
    layouts: Sequence[str], world_sizes: Sequence[int] | None = None, optim: str = "adamw"
) -> list[LayoutCase]:
    """One case per (save layout, load layout) pair; for each layout, the save sizes rotate
    over the load layouts and the load sizes over the save layouts, so each layout is saved
    and loaded at every size it runs at (given at least as many layouts as sizes)."""

    def sizes(name: str) -> list[int]:
        layout = lay.get_layout(name)
        return list(layout.matrix_sizes) if world_sizes is None else [n for n in world_sizes if layout.supports(n)]

    cases = []
    for i, a in enumerate(layouts):
        for j, b in enumerate(layouts):
            save_sizes, load_sizes = sizes(a), sizes(b)
            if not save_sizes or not load_sizes:
                continue
            n = save_sizes[j % len(save_sizes)]
            m = load_sizes[(i + 1) % len(load_sizes)]
            cases.append(LayoutCase(n, a, m, b, optim))
    return cases


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def build(
    spec: ModelSpec, layout: str, optim: str, seed: int, *, group=None, groups_2d=None, **kw
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The spec's model parallelized as `layout` over `group` and its optimizer."""
    model = spec.build(seed)
    mesh = lay.build_mesh(layout, group=group, groups_2d=groups_2d) if lay.get_layout(layout).mesh_dims else None
    wrapped = lay.apply_layout(
        model,
        layout,
        mesh,
        group=group,
        fsdp_units=spec.fsdp_units(model) if spec.fsdp_units else None,
        tp_plan=spec.tp_plan(model) if spec.tp_plan else None,
        after_tp=(lambda: spec.after_tp(model)) if spec.after_tp else None,
        **kw,
    )
    make = spec.optimizer or matrix.make_optimizer
    return wrapped, make(wrapped.parameters(), optim) if spec.optimizer else make(optim, wrapped.parameters())


def train_step(spec: ModelSpec, model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    spec.loss(model, step).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def save_layout(
    uri: str,
    layout: str,
    optim: str = "adamw",
    *,
    spec: ModelSpec = TRANSFORMER,
    steps: int = 2,
    group=None,
    groups_2d=None,
    checkpointer: Any = None,
) -> dict[str, Any]:
    """Train `steps` steps at `layout` on this group, save to `uri` through `checkpointer`
    (default: one ``ckptlib.save`` checkpoint); return the full saved state."""
    model, opt = build(spec, layout, optim, seed=0, group=group, groups_2d=groups_2d)
    for step in range(steps):
        train_step(spec, model, opt, step)
    state = {"model": model, "optim": opt, "step": steps}
    matrix.save_through(matrix.checkpointer_of(checkpointer, False, {"layout": layout}), uri, steps, state, group)
    return full_state(model, opt)


def load_layout(
    uri: str,
    layout: str,
    expected: dict[str, Any],
    optim: str = "adamw",
    *,
    spec: ModelSpec = TRANSFORMER,
    steps: int = 2,
    group=None,
    groups_2d=None,
    checkpointer: Any = None,
) -> matrix.Problems:
    """Load at `layout` on this group through `checkpointer`; compare what it carries with
    `expected` (the unsharded state, and this rank's shards against a never-checkpointed run's);
    train one more step and compare with that run. Returns the differences."""
    from ckptlib.testing.checkpointers.protocol import carried

    cp = matrix.checkpointer_of(checkpointer, False)
    model, opt = build(spec, layout, optim, seed=1, group=group, groups_2d=groups_2d)
    state = {"model": model, "optim": opt, "step": -1}
    carries = carried(cp, state)
    loaded_step = matrix.load_through(cp, uri, state, group)
    problems = matrix.step_problems(loaded_step, state, carries, steps)
    problems += _tie_problems(model)
    shards = matrix.local_state(model, {"optim": opt}, carries)
    loaded = full_state(model, opt)
    problems += matrix.differences(matrix.only(expected, carries), matrix.only(loaded, carries), "after-load")

    train_step(spec, model, opt, steps)
    resumed = full_state(model, opt)
    ref_model, ref_opt = build(spec, layout, optim, seed=2, group=group, groups_2d=groups_2d)
    start = {k: expected[k] if k in carries else loaded[k] for k in ("model", "optim")}
    set_full_state(ref_model, ref_opt, start, local_indices(spec, layout, optim, group=group, groups_2d=groups_2d))
    problems += matrix.differences(
        matrix.local_state(ref_model, {"optim": ref_opt}, carries), shards, "after-load.shard"
    )
    train_step(spec, ref_model, ref_opt, steps)
    problems += matrix.differences(full_state(ref_model, ref_opt), resumed, "train-after-load")
    return problems


def set_full_state(
    model: nn.Module, optim: torch.optim.Optimizer, full: dict[str, Any], indices: dict[str, torch.Tensor] | None = None
) -> None:
    """Give a parallelized model and its optimizer the unsharded state `full` (the same on
    every rank), without a checkpoint: the never-checkpointed reference run. `indices`
    (`local_indices`) cuts DTensors exactly as the layout did."""
    set_full_model(model, full["model"], indices)
    set_full_optimizer(model, optim, full["optim"], indices)


def local_indices(spec: ModelSpec, layout: str, optim: str, *, group=None, groups_2d=None) -> dict[str, torch.Tensor]:
    """{parameter FQN: the flat indices, into the full parameter, of this rank's local shard}
    under `layout`: the spec's model with every parameter numbering its own elements,
    parallelized like the real one. Needed where DTensor's own cut of a `_StridedShard` over
    an uneven dim differs from FSDP2's (torch 2.8: 8 rows against FSDP2's 9 of 37)."""

    def numbered(seed: int) -> nn.Module:
        model = spec.build(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if not param.is_floating_point() or param.numel() > 2**24:
                    raise ValueError(f"{name}: cannot number {param.numel()} {param.dtype} elements exactly")
                param.copy_(torch.arange(param.numel(), dtype=torch.float64).view_as(param))
        return model

    model, _ = build(dataclasses.replace(spec, build=numbered), layout, optim, seed=0, group=group, groups_2d=groups_2d)
    return {
        fqn: value.to_local().long() for fqn, value in get_model_state_dict(model).items() if hasattr(value, "to_local")
    }


def set_full_model(model: nn.Module, full: dict[str, Any], indices: dict[str, torch.Tensor] | None = None) -> None:
    """DTensor layouts are cut locally (by `indices`, else `parallel.distribute_locally`); others
    (plain, DDP, FSDP1's ShardedTensors) go through DCP's full-state setter."""
    msd = get_model_state_dict(model)
    if any(_is_sharded_tensor(v) for v in msd.values()):
        set_model_state_dict(model, matrix._to_cpu(full), options=StateDictOptions(full_state_dict=True))
    else:
        set_model_state_dict(model, _like(msd, full, indices or {}))


def set_full_optimizer(
    model: nn.Module, optim: torch.optim.Optimizer, full: dict[str, Any], indices: dict[str, torch.Tensor] | None = None
) -> None:
    if any(_is_sharded_tensor(v) for v in get_model_state_dict(model).values()):
        set_optimizer_state_dict(model, optim, matrix._to_cpu(full), options=StateDictOptions(full_state_dict=True))
    else:  # get_optimizer_state_dict initializes an empty optimizer's state first
        set_optimizer_state_dict(model, optim, _like(get_optimizer_state_dict(model, optim), full, indices or {}))


def _is_sharded_tensor(value: Any) -> bool:
    return type(value).__name__ == "ShardedTensor"  # FSDP1's sharded state dicts


def _like(template: Any, full: Any, indices: dict[str, torch.Tensor], path: tuple = ()) -> Any:
    """`full` with each tensor placed like the template's tensor at the same key: a DTensor
    below a parameter's FQN in `indices` (a model's key, an optimizer's "state" key) is cut by
    those indices, any other by `parallel.distribute_locally`."""
    from torch.distributed.tensor import DTensor

    if isinstance(full, dict):
        sub = template if isinstance(template, dict) else {}
        return {k: _like(sub.get(k), v, indices, (*path, k)) for k, v in full.items()}
    if isinstance(full, torch.Tensor):
        if not isinstance(template, DTensor):
            return full.clone()
        fqn = next((key for key in reversed(path) if key in indices), None)
        if fqn is None or full.shape != template.shape:
            return parallel.distribute_locally(full.clone(), template.device_mesh, template.placements)
        index = indices[fqn]
        local = full.reshape(-1)[index.reshape(-1)].view(index.shape).clone()
        return DTensor.from_local(
            local,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    return full


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """`matrix.full_state` with each param group's FQNs sorted: their order follows how a
    layout registers parameters (FSDP1 flat parameters reorder them), not the checkpoint."""
    state = matrix.full_state(model, optim)
    for group in state["optim"].get("param_groups", []):
        group["params"] = sorted(group["params"])
    return state


def _tie_problems(model: nn.Module) -> list[str]:
    """A tied head must still be the embedding's parameter after a load."""
    inner = _unwrap(model)
    head, embed = getattr(inner, "head", None), getattr(inner, "embed", None)
    if head is None or embed is None or not hasattr(inner, "retie"):
        return []
    if isinstance(getattr(head, "weight", None), nn.Parameter) and head.weight is not embed.weight:
        return ["tied weights: head.weight is no longer embed.weight after the load"]
    return []
