"""Parallelism layouts a checkpoint is saved from and loaded into, for any model (a
``ParallelLayout``; ``ckptlib.format.native.layout`` is another thing: what a checkpoint directory holds).

A layout is how a model's parameters are spread over ranks:

- ``plain``: every rank holds the whole unwrapped model (replicated).
- ``ddp``: ``DistributedDataParallel``.
- ``fsdp2``: ``fully_shard`` on a 1-D mesh (each unit from ``fsdp_units`` and the root).
- ``hsdp``: ``fully_shard`` on a 2-D (replicate, shard) mesh.
- ``tp``: ``parallelize_module`` with a tensor-parallel plan on a 1-D mesh.
- ``fsdp2+tp``: the TP plan on the inner dim of a 2-D (dp, tp) mesh, FSDP2 on the outer.
- ``fsdp1``: ``FullyShardedDataParallel`` (``use_orig_params=True``, and ``fsdp1-flat`` with
  ``use_orig_params=False``); needs an accelerator on torch versions that refuse CPU.

``apply_layout(model, layout, mesh)`` wraps a model; ``build_mesh(layout, world_size)``
makes its mesh. Models say what to shard: ``fsdp_units`` (submodules that get their own
FSDP unit) and ``tp_plan`` (a ``parallelize_module`` plan) are taken from the arguments or,
if absent, from methods of the same names on the model; ``after_tp`` (e.g. re-tie weights
that the plan replaced) from the argument or the model's ``retie()`` (as
``ckptlib.testing.matrices.models.TinyTransformer`` has).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ckptlib._torch import parallel


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    name: str
    mesh_dims: int  # 0: no mesh (plain, ddp, fsdp1), 1 or 2
    matrix_sizes: tuple[int, ...]  # world sizes in the test matrix
    mesh_names: tuple[str, ...] = ()

    def supports(self, world_size: int) -> bool:
        """Whether this layout can run at `world_size` (2-D layouts: 2 x n/2, n >= 4 even)."""
        if self.mesh_dims == 2:
            return world_size >= 4 and world_size % 2 == 0
        return world_size >= 1

    def mesh_shape(self, world_size: int) -> tuple[int, ...]:
        return (2, world_size // 2) if self.mesh_dims == 2 else (world_size,)

    def unavailable_reason(self, device: str = "cpu") -> str | None:
        """Why this torch cannot run the layout on `device`, or None."""
        gap = parallel.layout_gap_reason(self.name) if device == "cpu" else None
        if self.name in ("fsdp2", "hsdp", "fsdp2+tp"):
            return parallel.fsdp2_reason(device) or gap
        if self.name in ("fsdp1", "fsdp1-flat") and device == "cpu":
            return parallel.fsdp1_cpu_reason() or gap
        return None


LAYOUTS: dict[str, ParallelLayout] = {
    layout.name: layout
    for layout in (
        ParallelLayout("plain", 0, (1, 2, 3, 4)),
        ParallelLayout("ddp", 0, (1, 2, 3, 4)),
        ParallelLayout("fsdp2", 1, (1, 2, 3, 4), ("shard",)),
        ParallelLayout("hsdp", 2, (4,), ("replicate", "shard")),
        ParallelLayout("tp", 1, (1, 2, 3, 4), ("tp",)),
        ParallelLayout("fsdp2+tp", 2, (4,), ("dp", "tp")),
        ParallelLayout("fsdp1", 0, (1, 2, 3, 4)),
        ParallelLayout("fsdp1-flat", 0, (1, 2, 3, 4)),
    )
}


def get_layout(name: str) -> ParallelLayout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; choose from {', '.join(LAYOUTS)}") from None


def parse_layouts(text: str) -> list[str]:
    """'fsdp2,hsdp' -> ['fsdp2', 'hsdp'], every name checked."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("expected a comma-separated list of layouts")
    for name in names:
        get_layout(name)
    return list(dict.fromkeys(names))


def mesh_groups(world_sizes: Iterable[int], layouts: Iterable[str]) -> dict[tuple[str, int], Any]:
    """Process groups for every 2-D mesh that runs on the first n ranks of a bigger world.

    Collective over the default group: every rank must call it with the same arguments
    (new_group is). Returns {(layout, n): [dim-0 group, dim-1 group]} for the ranks that
    belong to the mesh, and the key is absent where n is the whole world (the mesh is
    built directly then).
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    out: dict[tuple[str, int], Any] = {}
    for name in layouts:
        layout = get_layout(name)
        if layout.mesh_dims != 2:
            continue
        for n in sorted(set(world_sizes)):
            if n == world or not layout.supports(n) or n > world:
                continue
            grid = torch.arange(n).view(layout.mesh_shape(n))
            mine: list[Any] = [None, None]
            for dim in range(2):
                for ranks in grid.transpose(dim, 1).reshape(-1, grid.shape[dim]).tolist():
                    group = dist.new_group(ranks=ranks)
                    if rank in ranks:
                        mine[dim] = group
            if rank < n:
                out[(name, n)] = mine
    return out


def build_mesh(layout: str | ParallelLayout, *, group=None, groups_2d=None, device: str = "cpu"):
    """The device mesh of `layout` over `group` (default: the whole world), or None.

    A 2-D mesh on a proper subgroup needs `groups_2d` from :func:`mesh_groups`.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    layout = get_layout(layout) if isinstance(layout, str) else layout
    if layout.mesh_dims == 0:
        return None
    n = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if not layout.supports(n):
        raise ValueError(f"layout {layout.name!r} cannot run on {n} ranks")
    shape = layout.mesh_shape(n)
    whole = group is None or n == dist.get_world_size()
    if whole:
        return init_device_mesh(device, shape, mesh_dim_names=layout.mesh_names)
    if layout.mesh_dims == 1:
        return DeviceMesh.from_group(group, device, mesh_dim_names=layout.mesh_names)
    if groups_2d is None:
        raise ValueError(f"layout {layout.name!r} on a subgroup of {n} ranks needs mesh_groups()")
    return DeviceMesh.from_group(
        list(groups_2d), device, mesh=torch.arange(n).view(shape), mesh_dim_names=layout.mesh_names
    )


def _model_hook(model: nn.Module, given: Any, name: str) -> Any:
    """`given`, else what the model's method `name()` returns, else None."""
    if given is not None:
        return given
    method = getattr(model, name, None)
    return method() if callable(method) else None


def apply_layout(
    model: nn.Module,
    layout: str | ParallelLayout,
    mesh=None,
    *,
    group=None,
    fsdp_units: Sequence[nn.Module] | None = None,
    tp_plan: dict[str, Any] | None = None,
    after_tp: Callable[[], None] | None = None,
    mp_policy: Any = None,
    device: str = "cpu",
) -> nn.Module:
    """`model` parallelized as `layout` on `mesh` (from :func:`build_mesh`); returns the
    module to train and checkpoint (the wrapper for ddp and fsdp1)."""
    layout = get_layout(layout) if isinstance(layout, str) else layout
    if layout.mesh_dims and mesh is None:
        mesh = build_mesh(layout, group=group, device=device)
    name = layout.name
    if name == "plain":
        return model
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=group)
    if name in ("fsdp1", "fsdp1-flat"):
        return _fsdp1(
            model,
            group,
            fsdp_units=_model_hook(model, fsdp_units, "fsdp_units"),
            use_orig_params=name == "fsdp1",
            device=device,
        )
    if name in ("tp", "fsdp2+tp"):
        from torch.distributed.tensor.parallel import parallelize_module

        plan = _model_hook(model, tp_plan, "tp_plan")
        if not plan:
            raise ValueError(f"layout {name!r} needs a tp_plan (argument or model.tp_plan())")
        parallelize_module(model, mesh["tp"], plan)
        if after_tp is not None:
            after_tp()
        elif callable(getattr(model, "retie", None)):
            model.retie()
        if name == "tp":
            return model
        mesh = mesh["dp"]
    fully_shard = parallel.require_fsdp2_cpu() if device == "cpu" else parallel.fully_shard_fn()
    kwargs = {"mesh": mesh}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for unit in _model_hook(model, fsdp_units, "fsdp_units") or ():
        fully_shard(unit, **kwargs)
    return fully_shard(model, **kwargs)


def _fsdp1(model: nn.Module, group, *, fsdp_units, use_orig_params: bool, device: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    reason = parallel.fsdp1_cpu_reason() if device == "cpu" else None
    if reason:
        raise RuntimeError(reason)
    units = {type(unit) for unit in (fsdp_units or ())}
    kwargs: dict[str, Any] = {"process_group": group, "use_orig_params": use_orig_params}
    if units:
        kwargs["auto_wrap_policy"] = ModuleWrapPolicy(units)
    # FSDP1 picks "the current accelerator" unless told: an explicit CPU device_id runs it on CPU.
    kwargs["device_id"] = torch.device("cpu") if device == "cpu" else torch.device(device, torch.cuda.current_device())
    return FSDP(model, **kwargs)
