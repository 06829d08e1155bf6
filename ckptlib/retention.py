"""Retention policies: which committed steps of a root to keep.

A policy sees every committed step with the metrics it was saved with and returns the steps
it keeps; policies combine with `|` (a step is kept if any policy keeps it). Whatever a
policy says, the manager never deletes the step `latest` names nor a save in flight: those
are protected outside the policies (see `ckptlib.collection`). Policies combine through
`ckptlib.policy`, as save policies do.

    KeepLast(3) | KeepEvery(1000) | KeepBest(2, "val_loss", mode="min")

"last" and "every" go by step number, not by save time: after a rollback (a run that resumed
from an older step and saves again), steps newer than the resumed one still count as the
newest until a save replaces them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from .policy import AnyOfPolicies, Combinable


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
