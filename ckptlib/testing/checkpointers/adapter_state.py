"""What the adapters of other tools' checkpointers share: how they read the harness's state.

The harness hands a checkpointer ``{"model": module, <optimizer names>: optimizer, <scheduler
and other stateful names>: object, <per-rank names>: ckptlib.RankLocal, "step": int, ...}``
(``spec_matrix.Training.state``). Each tool checkpoints some of it; :func:`parts` sorts the
entries the way every adapter needs them, :class:`Carries` is what an adapter promises to
restore, :class:`Values` carries plain values (``step``, ``epoch``) through a tool as one
stateful object, and :func:`package_version` reads a tool's installed version without
importing it. Nothing here imports torch at import time.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

from ckptlib.testing.checkpointers.protocol import CheckpointerError


def package_version(distribution: str) -> str | None:
    """The installed version of `distribution` (a pip name), None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_rank_local(value: Any) -> bool:
    from ckptlib.state.state import RankLocal

    return isinstance(value, RankLocal)


@dataclasses.dataclass
class Parts:
    """The harness's state, sorted: one model, its optimizers, objects with a state dict that
    are the same on every rank, per-rank objects (``RankLocal``) and plain values."""

    model_name: str
    model: Any
    optimizers: dict[str, Any]
    stateful: dict[str, Any]
    per_rank: dict[str, Any]
    values: dict[str, Any]


def parts(state: dict[str, Any], who: str) -> Parts:
    """`state` sorted into :class:`Parts`; a CheckpointerError naming `who` and the entries
    when there is not exactly one module (the tools below checkpoint one model)."""
    import torch
    from torch import nn

    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if len(modules) != 1:
        raise CheckpointerError(
            f"{who}: the state must hold exactly one nn.Module (the model), found {sorted(modules) or 'none'}"
        )
    ((model_name, model),) = modules.items()
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    per_rank = {k: v for k, v in state.items() if is_rank_local(v)}
    stateful, values = {}, {}
    for key, value in state.items():
        if key in modules or key in optimizers or key in per_rank:
            continue
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            stateful[key] = value
        else:
            values[key] = value
    return Parts(model_name, model, optimizers, stateful, per_rank, values)


def every_entry_but_per_rank(state: dict[str, Any]) -> frozenset[str]:
    """The entries a checkpointer that keeps one copy of everything but the model's and the
    optimizers' shards restores: all but the ``RankLocal`` ones."""
    return frozenset(k for k, v in state.items() if not is_rank_local(v))


class Carries:
    """What an adapter promises to restore, by a rule on the state (per-rank entries are told
    apart by their value, not their name): ``carries(state)`` is the set of names in `state` it
    restores; ``name in carries`` answers for the state the adapter was last handed by a save or
    load (:meth:`note`), and for every name before it was handed one."""

    def __init__(self, rule: Any):
        self.rule = rule
        self.last: frozenset[str] | None = None

    def __call__(self, state: dict[str, Any]) -> frozenset[str]:
        return frozenset(self.rule(state))

    def note(self, state: dict[str, Any]) -> None:
        self.last = self(state)

    def __contains__(self, name: object) -> bool:
        return self.last is None or name in self.last


class Values:
    """Plain values of the state (``step``, ``epoch``) as one stateful object a tool can save;
    after a load, :meth:`restore` writes them back into the state mapping."""

    def __init__(self, values: dict[str, Any]):
        self.values = dict(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = dict(state_dict)

    def restore(self, state: dict[str, Any]) -> None:
        for key, value in self.values.items():
            if key in state:
                state[key] = value


__all__ = ["Carries", "Parts", "Values", "every_entry_but_per_rank", "is_rank_local", "package_version", "parts"]
