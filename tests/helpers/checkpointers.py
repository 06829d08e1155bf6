"""Checkpointers with one real bug each, to prove `ckpt validate --checkpointer` and
`assert_elastic(checkpointer=...)` name what breaks (tests/elastic/test_checkpointers.py):

- `RankZeroShardOnly`: a homegrown wrapper written for DDP: rank 0 alone `torch.save`s its
  `state_dict()` (under FSDP2: its own shards only) into ``step-N/state.pt``; a load copies
  each saved tensor into every rank's tensor of that name whose shape fits (a lenient load).
- `FreshOptimizer`: plain DCP that starts the optimizer over after the load (its state lost,
  as after a key rename that a non-strict load skipped).
- `NextStep`: plain DCP that returns the step after the one it resumed (an off-by-one).
- `PerRankShared`: plain DCP that also saves per-rank state (``ckptlib.RankLocal``) and claims
  to carry it: DCP keeps one copy of a key every rank saves, so other ranks get that one's.
- `NoGroup`: plain DCP, correct, but its save/load take no process_group.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ckptlib
from ckptlib.testing.checkpointers.plain_dcp import DCPCheckpointer, newest_step


def _local(value):
    if hasattr(value, "to_local"):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    return value


def _fill(current, saved):
    """Copy `saved` into `current`'s tensors (a DTensor's local shard) where the shapes fit."""
    if isinstance(current, dict) and isinstance(saved, dict):
        for key, value in current.items():
            if key in saved:
                _fill(value, saved[key])
    elif isinstance(saved, torch.Tensor):
        local = _local(current)
        if isinstance(local, torch.Tensor) and local.shape == saved.shape:
            with torch.no_grad():
                local.copy_(saved)


class RankZeroShardOnly:
    name = "rank0-shard-only"
    carries = staticmethod(DCPCheckpointer.carries)

    def save(self, root, step, state, *, process_group=None):
        if dist.get_rank(process_group) == 0:
            model, optim = state["model"], state["optim"]
            local = {
                "model": _local(get_model_state_dict(model)),
                "optim": _local(get_optimizer_state_dict(model, optim)),
                "step": state["step"],
            }
            os.makedirs(os.path.join(root, f"step-{step}"))
            torch.save(local, os.path.join(root, f"step-{step}", "state.pt"))
            open(os.path.join(root, f"step-{step}", ".metadata"), "w").close()
        dist.barrier(group=process_group)

    def load(self, root, state, *, process_group=None):
        step = newest_step(root, process_group)
        saved = torch.load(os.path.join(root, f"step-{step}", "state.pt"), weights_only=False)
        model, optim = state["model"], state["optim"]
        msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
        _fill(msd, saved["model"])
        _fill(osd, saved["optim"])
        set_model_state_dict(model, msd)
        set_optimizer_state_dict(model, optim, osd)
        state["step"] = saved["step"]
        return step


class FreshOptimizer(DCPCheckpointer):
    name = "fresh-optimizer"

    def load(self, root, state, *, process_group=None):
        step = super().load(root, state, process_group=process_group)
        for value in state.values():
            if isinstance(value, torch.optim.Optimizer):
                value.state.clear()
        return step


class NextStep(DCPCheckpointer):
    name = "next-step"

    def load(self, root, state, *, process_group=None):
        step = super().load(root, state, process_group=process_group)
        return None if step is None else step + 1


class PerRankShared(DCPCheckpointer):
    name = "per-rank-shared"
    carries = None  # every entry

    def _split(self, root, state):
        out, plain = super()._split(root, state)
        out.update({key: value for key, value in state.items() if isinstance(value, ckptlib.RankLocal)})
        return out, plain


NOT_ONE = "a string is no checkpointer"


class NoGroup:
    """A checkpointer of the bare protocol: DCP on the default group."""

    def __init__(self):
        self.inner = DCPCheckpointer()
        self.carries = self.inner.carries

    def save(self, root, step, state):
        self.inner.save(root, step, state)

    def load(self, root, state):
        return self.inner.load(root, state)
