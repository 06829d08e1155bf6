"""Save-decision policies: when `CheckpointManager.maybe_save` saves.

A policy answers `should_save(context)`; policies combine with `|` (save if any says so).
Only rank 0 evaluates the policy, with rank 0's clock; `maybe_save` then hands the decision
to every rank in the one collective it makes per call, so ranks never disagree (a
time-based rule evaluated on each rank's own clock could split them).

    EveryNSteps(500) | EveryNSeconds(1800) | FinalStep(total_steps)
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from . import _dist
from .errors import CheckpointError
from .policy import AnyOfPolicies, Combinable


def clock() -> float:
    """The clock time-based policies use (monotonic seconds; tests replace it)."""
    return time.monotonic()


@dataclasses.dataclass(frozen=True)
class SaveContext:
    """What a policy decides from (on rank 0).

    `now` and `last_save_time` are `time.monotonic()` seconds; `last_save_time` is when this
    manager last saved (any save: `save`, `maybe_save`), or when it was created if it has not
    saved yet. `last_save_step` is None before the first save.
    """

    step: int
    now: float
    last_save_time: float
    last_save_step: int | None = None


@runtime_checkable
class SavePolicy(Protocol):
    def should_save(self, context: SaveContext) -> bool:
        """Whether to save at `context.step`."""


@dataclasses.dataclass(frozen=True)
class AnySavePolicy(AnyOfPolicies):
    """Save when any of `policies` says so (what `a | b` builds)."""

    policies: tuple
    member = SavePolicy
    what = "save policy"

    def should_save(self, context: SaveContext) -> bool:
        # Every policy is asked (no short cut), so stateful user policies see every step.
        return any([bool(p.should_save(context)) for p in self.policies])


def _positive_int(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EveryNSteps(Combinable, any_of=AnySavePolicy):
    """Save at every step that is a multiple of `n`."""

    n: int

    def __post_init__(self):
        _positive_int(self.n, "EveryNSteps n")

    def should_save(self, context: SaveContext) -> bool:
        return context.step % self.n == 0


@dataclasses.dataclass(frozen=True)
class EveryNSeconds(Combinable, any_of=AnySavePolicy):
    """Save once `seconds` of wall time (rank 0's monotonic clock) passed since the last save
    (or since the manager was created)."""

    seconds: float

    def __post_init__(self):
        if (
            isinstance(self.seconds, bool)
            or not isinstance(self.seconds, (int, float))
            or not (math.isfinite(self.seconds) and self.seconds > 0)
        ):
            raise ValueError(f"EveryNSeconds seconds must be a positive number, got {self.seconds!r}")

    def should_save(self, context: SaveContext) -> bool:
        return context.now - context.last_save_time >= self.seconds


@dataclasses.dataclass(frozen=True)
class FinalStep(Combinable, any_of=AnySavePolicy):
    """Save at the last step of training, `total_steps` (and at any step past it)."""

    total_steps: int

    def __post_init__(self):
        _positive_int(self.total_steps, "FinalStep total_steps")

    def should_save(self, context: SaveContext) -> bool:
        return context.step >= self.total_steps


@dataclasses.dataclass(frozen=True)
class AtSteps(Combinable, any_of=AnySavePolicy):
    """Save at the listed steps."""

    steps: frozenset

    def __init__(self, *steps: int):
        for s in steps:
            if not isinstance(s, int) or isinstance(s, bool) or s < 0:
                raise ValueError(f"AtSteps steps must be non-negative ints, got {s!r}")
        object.__setattr__(self, "steps", frozenset(steps))

    def should_save(self, context: SaveContext) -> bool:
        return context.step in self.steps


@dataclasses.dataclass(frozen=True)
class Decision:
    """What every rank learned from one `decide` round."""

    save: bool  # the policy (rank 0's answer) or some rank's force=True
    signal: int  # a preemption signal some rank received (the highest number), 0 for none

    @property
    def preempted(self) -> bool:
        return self.signal > 0


def decide(policy_on_rank0: Callable[[], bool], *, force: bool, signal: int | None, group=None) -> Decision:
    """One small all_reduce (MAX) that gives every rank the same decision: rank 0's policy
    answer, whether any rank passed `force`, and the preemption signal any rank received.
    A policy that raised on rank 0 raises there and a CheckpointError on the other ranks."""
    rank0 = _dist.get_rank(group) == 0
    wanted, failure = False, None
    if rank0:
        try:
            wanted = bool(policy_on_rank0())
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the collective
            failure = exc
    flags = [int(wanted or force), int(signal or 0), int(failure is not None)]
    if _dist.is_distributed():
        tensor = torch.tensor(flags, dtype=torch.int32, device=_dist._flag_device(group))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        flags = [int(v) for v in tensor.tolist()]
    if failure is not None:
        raise failure
    if flags[2]:
        raise CheckpointError("rank 0: the save policy raised (its traceback is on rank 0)", rank=0)
    return Decision(save=bool(flags[0]), signal=flags[1])


__all__ = [
    "Decision",
    "decide",
    "AnySavePolicy",
    "AtSteps",
    "EveryNSeconds",
    "EveryNSteps",
    "FinalStep",
    "SaveContext",
    "SavePolicy",
]
