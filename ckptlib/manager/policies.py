"""Retention policies: which committed steps of a root to keep.

A policy sees every committed step with the metrics it was saved with and returns the steps
it keeps; policies combine with `|` (a step is kept if any policy keeps it). Whatever a
policy says, the manager never deletes the step `latest` names nor a save in flight: those
are protected outside the policies (see `ckptlib.manager.cleanup`). Policies combine through
`ckptlib.manager.policies`, as save policies do.

    KeepLast(3) | KeepEvery(1000) | KeepBest(2, "val_loss", mode="min")

"last" and "every" go by step number, not by save time: after a rollback (a run that resumed
from an older step and saves again), steps newer than the resumed one still count as the
newest until a save replaces them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, ClassVar, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from ckptlib._runtime import agree as _dist
from ckptlib.errors import CheckpointError
from ckptlib.manager.arguments import check_votes, encode, votes_of


class Combinable:
    """A policy that combines with `|` (save if any says so, keep if any keeps) with any object
    satisfying its family's protocol, including a user's own policy on either side."""

    _any_of: ClassVar[type[AnyOfPolicies]]

    def __init_subclass__(cls, *, any_of: type[AnyOfPolicies] | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if any_of is not None:
            cls._any_of = any_of

    def __or__(self, other: Any) -> Any:
        if not isinstance(other, self._any_of.member):
            return NotImplemented
        return self._any_of((self, other))

    def __ror__(self, other: Any) -> Any:
        if not isinstance(other, self._any_of.member):
            return NotImplemented
        return self._any_of((other, self))


class AnyOfPolicies(Combinable):
    """The base of a family's "any of" policy (a frozen dataclass with a `policies` tuple):
    `member` is the family's protocol, `what` names a member in errors. Nested combinations
    are flattened, so `a | b | c` holds three policies."""

    member: ClassVar[type]
    what: ClassVar[str]
    policies: tuple

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(any_of=cls, **kwargs)

    def __post_init__(self) -> None:
        flat: list = []
        for policy in self.policies:
            if not isinstance(policy, self.member):
                raise TypeError(f"not a {self.what}: {policy!r}")
            flat.extend(policy.policies if isinstance(policy, type(self)) else (policy,))
        object.__setattr__(self, "policies", tuple(flat))


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


def decide(
    policy_on_rank0: Callable[[], bool], *, force: bool, signal: int | None, group=None, step: int | None = None
) -> Decision:
    """One small all_reduce (MAX) that gives every rank the same decision: rank 0's policy
    answer, whether any rank passed `force`, and the preemption signal any rank received.
    A policy that raised on rank 0 raises there and a CheckpointError on the other ranks.
    `step` (maybe_save's) rides in the same round: RanksDisagreeError on every rank when the
    ranks passed different steps."""
    rank0 = _dist.get_rank(group) == 0
    wanted, failure = False, None
    if rank0:
        try:
            wanted = bool(policy_on_rank0())
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the collective
            failure = exc
    mine = [encode(step)]
    flags = [int(wanted or force), int(signal or 0), int(failure is not None), *votes_of(mine)]
    if _dist.is_distributed():
        tensor = torch.tensor(flags, dtype=torch.int64, device=_dist._flag_device(group))
        with _dist.peer_loss_as_error("maybe_save's decision", group, step=step):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        flags = [int(v) for v in tensor.tolist()]
    if failure is not None:
        raise failure
    if flags[2]:
        raise CheckpointError("rank 0: the save policy raised (its traceback is on rank 0)", rank=0)
    check_votes("maybe_save", ["step"], mine, flags[3:], group)
    return Decision(save=bool(flags[0]), signal=flags[1])


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """A committed step as retention sees it: its number and the metrics saved with it."""

    step: int
    metrics: Mapping[str, float | None] = dataclasses.field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides which committed steps stay."""

    def keep(self, records: Sequence[StepRecord]) -> set[int]:
        """The steps (of `records`) to keep; every other unprotected committed step is deleted.

        A policy that never looks at metrics may set `uses_metrics = False`: the manager then
        skips reading the steps' manifests (one read per step on S3)."""


@dataclasses.dataclass(frozen=True)
class AnyOf(AnyOfPolicies):
    """Keep a step if any of `policies` keeps it (what `a | b` builds)."""

    policies: tuple
    member = RetentionPolicy
    what = "retention policy"

    @property
    def uses_metrics(self) -> bool:
        # A policy without the attribute may read metrics (the manager's default too).
        return any(getattr(p, "uses_metrics", True) for p in self.policies)

    def keep(self, records: Sequence[StepRecord]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= set(p.keep(records))
        return kept


def _positive(value: Any, what: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KeepLast(Combinable, any_of=AnyOf):
    """Keep the `n` highest-numbered committed steps (None keeps all)."""

    n: int | None = None
    uses_metrics = False

    def __post_init__(self):
        _positive(self.n, "KeepLast n (keep_last)", allow_none=True)

    def keep(self, records: Sequence[StepRecord]) -> set[int]:
        steps = sorted(r.step for r in records)
        return set(steps) if self.n is None else set(steps[-self.n :])


@dataclasses.dataclass(frozen=True)
class KeepEvery(Combinable, any_of=AnyOf):
    """Keep milestones: every step that is a multiple of `k` (step 0 included)."""

    k: int
    uses_metrics = False

    def __post_init__(self):
        _positive(self.k, "KeepEvery k")

    def keep(self, records: Sequence[StepRecord]) -> set[int]:
        return {r.step for r in records if r.step % self.k == 0}


def metric_value(record: StepRecord, metric: str) -> float | None:
    """The finite value of `metric` in a step's metrics, or None (absent, null, NaN, inf, not a number)."""
    value = record.metrics.get(metric) if isinstance(record.metrics, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class KeepBest(Combinable, any_of=AnyOf):
    """Keep the `k` steps with the best value of `metric` (`mode="min"`: lowest is best).

    Steps saved without the metric (or with a NaN/infinite value) are never "best": this
    policy does not keep them (combine it with KeepLast to keep recent ones anyway). Equal
    values are ranked newer step first, so a tie keeps the most recent steps.
    """

    k: int
    metric: str
    mode: str = "min"
    uses_metrics = True

    def __post_init__(self):
        _positive(self.k, "KeepBest k")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest metric must be a non-empty string, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, records: Sequence[StepRecord]) -> set[int]:
        scored = [(v, r.step) for r in records if (v := metric_value(r, self.metric)) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))  # best first; a tie: newer first
        return {step for _, step in scored[: self.k]}


def to_delete(policy: RetentionPolicy, records: Iterable[StepRecord], protected: Iterable[int]) -> list[int]:
    """The committed steps `policy` does not keep, minus `protected`, oldest first."""
    records = list(records)
    kept = set(policy.keep(records)) | set(protected)
    return sorted(r.step for r in records if r.step not in kept)


def parse_keep_best(spec: str) -> KeepBest:
    """`K:METRIC[:min|max]` (the `ckpt gc --keep-best` syntax) -> KeepBest; ValueError otherwise."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1]:
        raise ValueError(f"--keep-best wants K:METRIC[:min|max], got {spec!r}")
    try:
        count = int(parts[0])
    except ValueError:
        raise ValueError(f"--keep-best wants K:METRIC[:min|max] with an integer K, got {spec!r}") from None
    return KeepBest(count, parts[1], parts[2] if len(parts) == 3 else "min")


__all__ = ["AnyOf", "KeepBest", "KeepEvery", "KeepLast", "RetentionPolicy", "StepRecord", "metric_value", "to_delete"]
