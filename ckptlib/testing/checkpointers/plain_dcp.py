"""Plain ``torch.distributed.checkpoint`` as a checkpointer, the way DCP's docs and tutorials
use it: ``dcp.save`` / ``dcp.load`` of an app state whose model and optimizers go through
``torch.distributed.checkpoint.state_dict`` (``get_*_state_dict`` / ``set_*_state_dict``), one
directory ``step-N`` per save, the newest step found by listing the root (a step counts once
its ``.metadata`` exists: DCP writes it last).

Reference: ``ckptlib.testing.checkpointers.plain_dcp:DCPCheckpointer`` (also
``ckptlib.testing.checkpointers:DCPCheckpointer``).

What it carries: the model, each optimizer, every other stateful object (``state_dict`` /
``load_state_dict``, e.g. LR schedulers: DCP calls them itself) and plain values such as the
step. Not carried: per-rank state (``ckptlib.RankLocal``: RNG, a data loader's position). DCP
keeps one copy of a non-tensor value saved under the same key by every rank, so one rank's
state would come back on all of them; and keys per rank would not reshard to another world
size. The harness reports those entries as not carried.

The state must hold exactly one ``nn.Module`` (the optimizers' model). Local paths only (a
URI root is a CheckpointerError naming it).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptlib.testing.checkpointers.protocol import CheckpointerError

STEP_DIR = re.compile(r"step-(\d+)")


class _AppState:
    """The tutorial's ``AppState``: a DCP ``Stateful`` over the model and its optimizers."""

    def __init__(self, model: Any, optimizers: dict[str, Any]):
        self.model, self.optimizers = model, optimizers

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        out = {"model": get_model_state_dict(self.model)}
        for name, optim in self.optimizers.items():
            out[name] = get_optimizer_state_dict(self.model, optim)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state_dict["model"])
        for name, optim in self.optimizers.items():
            set_optimizer_state_dict(self.model, optim, state_dict[name])


def _per_rank(value: Any) -> bool:
    from ckptlib import RankLocal

    return isinstance(value, RankLocal)


class DCPCheckpointer:
    """``dcp.save`` / ``dcp.load`` under ``root/step-N`` (see the module docstring)."""

    name = "dcp"

    @staticmethod
    def carries(state: dict) -> set[str]:
        return {key for key, value in state.items() if not _per_rank(value)}

    def _split(self, root: str, state: dict) -> tuple[dict[str, Any], list[str]]:
        """(the dict handed to DCP, the names of its plain values, copied back after a load)."""
        import torch
        from torch import nn

        if "://" in root:
            raise CheckpointerError(f"checkpointer dcp: {root}: plain DCP here writes local paths only")
        models = [key for key, value in state.items() if isinstance(value, nn.Module)]
        if len(models) != 1:
            raise CheckpointerError(f"checkpointer dcp: the state needs exactly one nn.Module, found {models}")
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        out: dict[str, Any] = {"app": _AppState(state[models[0]], optimizers)}
        plain = []
        for key, value in state.items():
            if key in models or key in optimizers or _per_rank(value):
                continue
            if key == "app":
                raise CheckpointerError("checkpointer dcp: the state entry 'app' is the adapter's own key")
            out[key] = value  # a Stateful object (DCP calls state_dict/load_state_dict) or a plain value
            if not (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))):
                plain.append(key)
        return out, plain

    def save(self, root: str, step: int, state: dict, *, process_group: Any = None) -> None:
        import torch.distributed.checkpoint as dcp

        to_save, _ = self._split(root, state)
        dcp.save(to_save, checkpoint_id=os.path.join(root, f"step-{step}"), process_group=process_group)

    def load(self, root: str, state: dict, *, process_group: Any = None) -> int | None:
        import torch.distributed.checkpoint as dcp

        to_load, plain = self._split(root, state)
        step = newest_step(root, process_group)
        if step is None:
            return None
        dcp.load(to_load, checkpoint_id=os.path.join(root, f"step-{step}"), process_group=process_group)
        for key in plain:
            state[key] = to_load[key]
        return step


def newest_step(root: str, process_group: Any = None) -> int | None:
    """The largest N of the ``step-N`` directories under `root` holding a ``.metadata``, listed
    on the group's first rank and broadcast (every rank resumes the same step)."""
    import torch.distributed as dist

    def listed() -> int | None:
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return None
        steps = [
            int(match.group(1))
            for match in map(STEP_DIR.fullmatch, names)
            if match and os.path.isfile(os.path.join(root, match.group(0), ".metadata"))
        ]
        return max(steps, default=None)

    if not (dist.is_available() and dist.is_initialized()):
        return listed()
    box = [listed() if dist.get_rank(process_group) == 0 else None]
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast_object_list(box, src=src, group=process_group)
    return box[0]


__all__ = ["DCPCheckpointer", "newest_step"]
