"""torchtitan's checkpoints (measured on torchtitan 0.3.0, its `CheckpointManager`).

A save folder (`<dump_folder>/<checkpoint.folder>`) holds one DCP directory per checkpoint,
`step-<N>`; the newest is the highest N that holds `.metadata` (torchtitan keeps no
pointer). One flat state dict:

    <fqn>                                   the model, at the top level (-> "model.<fqn>")
    optimizer.state.<param fqn>.<slot>      the optimizer in torch's flattened layout
    optimizer.param_groups.<param fqn>.<k>  (one copy of each group setting per parameter)
    lr_scheduler.last_epoch, dataloader.dp_rank_<r>, dataloader.world_size,
    train_state.step, train_state.ntokens_seen

The flattened optimizer layout cannot be renamed onto ckptlib's nested one (it has a group
setting per parameter, not per group): a load with this preset reads a torch optimizer of
the state through `FlatOptimizer` (torch's `flatten_optimizer_state_dict=True`), paired with
the module that owns its parameters.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ckptlib.errors import StateError
from ckptlib.presets.preset import Entries, Preset, Rename, read_objects
from ckptlib.storage.base import Storage

# Top-level entries of torchtitan's state besides the model's own keys.
NON_MODEL = ("optimizer", "lr_scheduler", "dataloader", "train_state")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class FlatOptimizer:
    """An optimizer's state in torch's flattened layout (`state.<fqn>.<slot>`,
    `param_groups.<fqn>.<setting>`), as torchtitan saves it; a stateful object ckptlib saves
    and loads at any world size like the optimizer itself."""

    flat_optimizer_state = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        flat = get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)
        return {k: v for k, v in flat.items() if not _is_names(k)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        live = get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)
        names = {k: v for k, v in live.items() if _is_names(k)}
        set_optimizer_state_dict(self.model, self.optimizer, {**names, **state_dict}, options=_FLAT)


def _is_names(key: str) -> bool:
    """`param_groups.<fqn>.param_names`: what torch adds for an optimizer built from (name,
    param) pairs; the optimizer's own, never saved (torchtitan leaves it out)."""
    return key.startswith("param_groups.") and key.endswith(".param_names")


def _owner(name: str, optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise StateError(f"optimizer state[{name!r}] has parameters that belong to no nn.Module in the state")


def flat_optimizers(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` with each torch optimizer read and written in torchtitan's flattened layout."""
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    return {
        name: FlatOptimizer(_owner(name, value, modules), value) if isinstance(value, torch.optim.Optimizer) else value
        for name, value in state.items()
    }


class TorchtitanPreset(Preset):
    name = "torchtitan"
    client = "torchtitan 0.3 (CheckpointManager)"
    folder_re = re.compile(r"^step-(?P<step>\d+)$")

    def rename(self, entries: Entries) -> Rename:
        model = entries.model + "."
        optim = entries.optimizer(0) + "."

        def rename(key: str) -> str:
            top = key.split(".", 1)[0]
            if top == "optimizer":
                return optim + key[len("optimizer.") :]
            return key if top in NON_MODEL else model + key

        return rename

    def model_name(self, key: str) -> str | None:
        return None if key.split(".", 1)[0] in NON_MODEL else key

    def adapt_state(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        return flat_optimizers(state)

    def progress(self, storage: Storage, *, trusted: bool) -> tuple[int | None, dict[str, Any]]:
        """`train_state` (step, tokens seen) and the schedulers' `last_epoch`; the step is
        train_state.step, else the folder's number."""
        found = read_objects(storage, lambda k: k.startswith(("train_state.", "lr_scheduler.")), trusted=trusted)
        out: dict[str, Any] = {}
        for key, value in found.items():
            top, rest = key.split(".", 1)
            out.setdefault(top, {})[rest] = value
        step = out.get("train_state", {}).get("step")
        if not isinstance(step, int):
            step = self.step_of(storage.uri.rstrip("/").rsplit("/", 1)[-1])
        return step, out


__all__ = ["FlatOptimizer", "NON_MODEL", "TorchtitanPreset", "flat_optimizers"]
