"""The layout round trip on the user's own training job (a :class:`training_spec.TrainingSpec`):
train and save at layout A on N ranks, load at layout B on M ranks, compare every part of the
state bit-exactly, then train one more step and compare with a run that got the saved state
without a checkpoint.

What is compared: the full (unsharded) model state, each optimizer's full state, each
scheduler's and each other stateful object's ``state_dict()``, the ``step``, and on every rank
its per-rank state (``ckptlib.RankLocal``): at the same world size its own saved state; at
another, what the object's resize policy says (another saved rank's state, every saved rank's
state merged, or a fresh start, which the reference run makes too). Every call into the spec
goes through ``training_spec.call_user`` (failures name the rank and carry the traceback), and
the ranks agree after each local factory before any collective, so a factory that fails on
one rank fails every rank instead of leaving the others in a collective.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckptlib._runtime import agree as _dist
from ckptlib.state.state import ResizeWarning
from ckptlib.testing.matrices import layout_matrix, matrix
from ckptlib.testing.matrices import parallel_layouts as lay
from ckptlib.testing.matrices.training_spec import SpecError, TrainingSpec, call_user

FULL = StateDictOptions(full_state_dict=True)
RESERVED = ("model", "step")


@dataclasses.dataclass
class Training:
    """One rank's training job built from a spec: what ``train_step(training, step)`` gets.

    ``model`` is the parallelized model, ``optimizers`` / ``schedulers`` / ``extras`` map the
    names they are saved under to the objects the spec's factories returned, ``rank`` and
    ``world_size`` are this case's (a subgroup ``group`` of a bigger launch)."""

    model: nn.Module
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    extras: dict[str, Any]
    rank: int
    world_size: int
    group: Any
    layout: str
    spec: TrainingSpec
    groups_2d: Any = None  # a 2-D layout's mesh groups on a subgroup (parallel_layouts.mesh_groups)
    _iters: dict[str, Any] = dataclasses.field(default_factory=dict)

    def loaders(self) -> dict[str, Any]:
        """The extras that are data loaders (iterable, with state): {name: the loader}."""
        out = {}
        for name, value in self.extras.items():
            inner = getattr(value, "obj", value) if _is_rank_local(value) else value
            if hasattr(inner, "__iter__") and callable(getattr(inner, "state_dict", None)):
                out[name] = inner
        return out

    def next_batch(self, name: str | None = None) -> Any:
        """The next batch of the data loader `name` (default: the only one); a new epoch
        starts where the last one ended. The iterator is made on first use, so a loader
        restored by a load resumes where it was saved."""
        loaders = self.loaders()
        if name is None:
            if len(loaders) != 1:
                raise SpecError(f"next_batch() needs a loader name: the state has loaders {sorted(loaders)}")
            name = next(iter(loaders))
        if name not in loaders:
            raise SpecError(f"next_batch({name!r}): no data loader of that name in the state ({sorted(loaders)})")
        if name not in self._iters:
            self._iters[name] = iter(loaders[name])
        try:
            return next(self._iters[name])
        except StopIteration:
            self._iters[name] = iter(loaders[name])
            return next(self._iters[name])

    def state(self, step: int) -> dict[str, Any]:
        """The mapping handed to ckptlib.save/load."""
        return {"model": self.model, **self.optimizers, **self.schedulers, **self.extras, "step": step}


def _is_rank_local(value: Any) -> bool:
    import ckptlib

    return isinstance(value, ckptlib.RankLocal)


def _named(value: Any, default: str, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, tuple)):
        raise SpecError(f"{what} returned a {type(value).__name__}; return one object or a dict {{name: object}}")
    return {default: value}


def _check_names(parts: dict[str, dict[str, Any]]) -> None:
    seen: dict[str, str] = {}
    for what, named in parts.items():
        for name in named:
            if not isinstance(name, str) or not name or "." in name:
                raise SpecError(f"{what}: name {name!r} must be a non-empty string without '.'")
            if name in RESERVED or name in seen:
                other = seen.get(name, "ckptlib's round trip")
                raise SpecError(f"{what}: name {name!r} is also used by {other}; give it another name")
            seen[name] = what


def build_training(spec: TrainingSpec, layout: str, seed: int, *, group=None, groups_2d=None) -> Training:
    """The spec's job at `layout` on this group (collective). The model factory and the
    layout hooks run first and the ranks agree; then the layout wraps the model; then the
    optimizers, schedulers and state are built and the ranks agree again."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    needs_tp = layout in ("tp", "fsdp2+tp")

    def make_model():
        model = call_user(spec.build_model, f"build_model({seed})", seed, rank=rank)
        if not isinstance(model, nn.Module):
            raise SpecError(f"rank {rank}: build_model({seed}) returned {type(model).__name__}, not an nn.Module")
        units = call_user(spec.fsdp_units, "fsdp_units(model)", model, rank=rank) if spec.fsdp_units else None
        plan = call_user(spec.tp_plan, "tp_plan(model)", model, rank=rank) if spec.tp_plan and needs_tp else None
        return model, units, plan

    model, units, plan = _dist.agree(make_model, group)
    after_tp = (lambda: call_user(spec.after_tp, "after_tp(model)", model, rank=rank)) if spec.after_tp else None
    mesh = lay.build_mesh(layout, group=group, groups_2d=groups_2d) if lay.get_layout(layout).mesh_dims else None
    wrapped = lay.apply_layout(model, layout, mesh, group=group, fsdp_units=units, tp_plan=plan, after_tp=after_tp)

    def make_rest() -> Training:
        if spec.build_optimizers is not None:
            made = call_user(spec.build_optimizers, "build_optimizers(model)", wrapped, rank=rank)
        else:
            made = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        optimizers = _named(made, "optim", "build_optimizers")
        schedulers = {}
        if spec.build_schedulers is not None:
            made = call_user(spec.build_schedulers, "build_schedulers(optimizers)", dict(optimizers), rank=rank)
            schedulers = _named(made, "scheduler", "build_schedulers")
        extras = {}
        if spec.build_state is not None:
            made = call_user(spec.build_state, f"build_state({rank}, {world})", rank, world, rank=rank)
            extras = _named(made, "state", "build_state")
        for name, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise SpecError(f"build_optimizers: {name!r} is a {type(opt).__name__}, not a torch.optim.Optimizer")
        for name, obj in {**schedulers, **extras}.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise SpecError(f"{name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()")
        _check_names({"build_optimizers": optimizers, "build_schedulers": schedulers, "build_state": extras})
        if spec.train_step is None and spec.loss is None:
            raise SpecError(f"spec {spec.label}: needs train_step(training, step) or loss(model, batch)")
        return Training(wrapped, optimizers, schedulers, extras, rank, world, group, layout, spec, groups_2d)

    return _dist.agree(make_rest, group)


def train(training: Training, step: int) -> None:
    """One step: the spec's train_step, or the default step around its loss."""
    spec, rank = training.spec, training.rank
    if spec.train_step is not None:
        call_user(spec.train_step, f"train_step(training, {step})", training, step, rank=rank)
        return
    if spec.batch is not None:
        data = call_user(spec.batch, f"batch(training, {step})", training, step, rank=rank)
    elif len(training.loaders()) == 1:
        data = training.next_batch()
    else:
        data = step
    loss = call_user(spec.loss, f"loss(model, batch of step {step})", training.model, data, rank=rank)
    call_user(loss.backward, f"loss(...).backward() at step {step}", rank=rank)
    for opt in training.optimizers.values():
        opt.step()
    for opt in training.optimizers.values():
        opt.zero_grad(set_to_none=True)
    for sched in training.schedulers.values():
        sched.step()


def full_state(training: Training) -> dict[str, Any]:
    """Every part's state that is the same on every rank, unsharded, as CPU values (collective)."""
    model = training.model
    out: dict[str, Any] = {"model": matrix._to_cpu(get_model_state_dict(model, options=FULL))}
    for name, opt in training.optimizers.items():
        osd = matrix._to_cpu(get_optimizer_state_dict(model, opt, options=FULL))
        for group in osd.get("param_groups", []):
            group["params"] = sorted(group["params"])
        out[name] = osd
    for name, obj in {**training.schedulers, **training.extras}.items():
        if not _is_rank_local(obj):
            out[name] = matrix._to_cpu(copy.deepcopy(obj.state_dict()))
    return out


def rank_states(training: Training) -> dict[str, Any]:
    """This rank's per-rank state (its RankLocal objects), as CPU values."""
    return {
        name: matrix._to_cpu(copy.deepcopy(obj.state_dict()))
        for name, obj in training.extras.items()
        if _is_rank_local(obj)
    }


def expected_rank_states(training: Training, saved: dict[str, list[Any]]) -> dict[str, tuple[str, Any]]:
    """What each RankLocal of this rank must hold after a load of `saved` ({name: the saved
    ranks' states}): ("saved", state), ("merged", state) or ("fresh", None), by its policy."""
    out = {}
    rank, world = training.rank, training.world_size
    for name, obj in training.extras.items():
        if not _is_rank_local(obj):
            continue
        states = saved[name]
        merge = getattr(obj.policy, "merge", None)
        if len(states) != world and callable(merge):
            out[name] = ("merged", merge(copy.deepcopy(states), rank, world))
            continue
        source = rank if len(states) == world else obj.policy.source_rank(rank, len(states), world)
        out[name] = ("fresh", None) if source is None else ("saved", states[source])
    return out


def _set_reference(training: Training, full: dict[str, Any], ranked: dict[str, tuple[str, Any]], step: int) -> None:
    """Give a freshly built job the saved state without a checkpoint (the reference run)."""
    spec = training.spec
    model_spec = layout_matrix.ModelSpec(
        build=spec.build_model, fsdp_units=spec.fsdp_units, tp_plan=spec.tp_plan, after_tp=spec.after_tp
    )
    indices = None
    if lay.get_layout(training.layout).mesh_dims:  # DTensors: cut exactly as the layout did
        indices = layout_matrix.local_indices(
            model_spec, training.layout, "sgd", group=training.group, groups_2d=training.groups_2d
        )
    layout_matrix.set_full_model(training.model, full["model"], indices)
    for name, opt in training.optimizers.items():
        layout_matrix.set_full_optimizer(training.model, opt, full[name], indices)
    for name, obj in {**training.schedulers, **training.extras}.items():
        if not _is_rank_local(obj):
            obj.load_state_dict(copy.deepcopy(full[name]))
    for name, (how, value) in ranked.items():
        obj = training.extras[name]
        if how == "fresh":
            obj.start_fresh(step, training.rank)
        else:
            obj.load_state_dict(copy.deepcopy(value))


def save_spec(
    uri: str, spec: TrainingSpec, layout: str, *, group=None, groups_2d=None, checkpointer: Any = None
) -> dict[str, Any]:
    """Train `spec.steps` steps at `layout` on this group and save to `uri` through
    `checkpointer` (default: one ``ckptlib.save`` checkpoint). Returns the saved state:
    {"full": full_state, "ranks": {RankLocal name: every saved rank's state}} (collective)."""
    training = build_training(spec, layout, 0, group=group, groups_2d=groups_2d)
    for step in range(spec.steps):
        train(training, step)
    cp = matrix.checkpointer_of(checkpointer, False, {"layout": layout, "spec": spec.label})
    matrix.save_through(cp, uri, spec.steps, training.state(spec.steps), group)
    full = full_state(training)
    mine = rank_states(training)
    gathered: list[Any] = [None] * training.world_size
    dist.all_gather_object(gathered, mine, group=group)
    return {"full": full, "ranks": {name: [per_rank[name] for per_rank in gathered] for name in mine}}


def load_spec_layout(
    uri: str,
    spec: TrainingSpec,
    layout: str,
    expected: dict[str, Any],
    *,
    group=None,
    groups_2d=None,
    checkpointer: Any = None,
) -> matrix.Problems:
    """Load at `layout` on this group through `checkpointer`; compare what it carries with
    `expected` (from `save_spec`; this rank's shards against a never-checkpointed run's);
    train one more step and compare with that run, which takes the entries not carried from
    the loaded run. Returns this rank's differences."""
    from ckptlib.testing.checkpointers.protocol import carried

    steps = spec.steps
    cp = matrix.checkpointer_of(checkpointer, False)
    training = build_training(spec, layout, 1, group=group, groups_2d=groups_2d)
    state = training.state(-1)
    carries = carried(cp, state)
    with warnings.catch_warnings():  # a resize is what this case is about: its notes are expected
        warnings.simplefilter("ignore", ResizeWarning)
        loaded_step = matrix.load_through(cp, uri, state, group)
    problems = matrix.step_problems(loaded_step, state, carries, steps)
    mine = rank_states(training)
    ranked = expected_rank_states(training, expected["ranks"])
    for name in set(ranked) - carries:  # the reference keeps what the load left
        ranked[name] = ("saved", mine[name])
    for name, (how, value) in ranked.items():
        if how != "fresh" and name in carries:
            problems += matrix.differences(value, mine[name], f"after-load.rank{training.rank}.{name}({how})")
    shards = matrix.local_state(training.model, training.optimizers, carries)
    loaded = full_state(training)
    problems += matrix.differences(matrix.only(expected["full"], carries), matrix.only(loaded, carries), "after-load")

    train(training, steps)
    resumed = {"full": full_state(training), "ranks": rank_states(training)}
    reference = build_training(spec, layout, 2, group=group, groups_2d=groups_2d)
    start = {k: value if k in carries else loaded[k] for k, value in expected["full"].items()}
    _set_reference(reference, start, ranked, steps)
    problems += matrix.differences(
        matrix.local_state(reference.model, reference.optimizers, carries), shards, "after-load.shard"
    )
    train(reference, steps)
    problems += matrix.differences(
        {"full": full_state(reference), "ranks": rank_states(reference)}, resumed, "train-after-load"
    )
    return problems


__all__ = ["Training", "build_training", "full_state", "load_spec_layout", "save_spec", "train"]
