"""Where a CheckpointManager's steps live: the interface every tier answers (`Tier`), and the
single root, the tier of a manager without `cluster=`.

A tier saves, loads, lists and collects steps and waits for its background work; the manager
around it (save policy, preemption, async handles, initial load) never asks which tier it
holds. The cluster tier (`ckptlib.manager.cluster.cluster_tier.ClusterTier`) answers the same.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Protocol

from ckptlib._runtime import agree as _dist
from ckptlib._runtime.observe import log_operation
from ckptlib.format.native.root import (
    LATEST,
    StalePointerWarning,
    committed_steps,
    replace_reason,
    resolve_latest,
    scan,
    step_dir,
)
from ckptlib.format.write.plan_cache import PlanCache
from ckptlib.loading.loading import LoadResult
from ckptlib.manager.cleanup import collect
from ckptlib.manager.local_budget import LocalUsage, usage
from ckptlib.manager.lock import RootLock
from ckptlib.manager.policies import RetentionPolicy
from ckptlib.manager.root_load import load_step
from ckptlib.saving.async_mode import AsyncMode
from ckptlib.saving.background_save import AsyncSave
from ckptlib.saving.saving import SaveResult, transact
from ckptlib.storage.base import Storage


@dataclasses.dataclass
class TierSettings:
    """What a manager hands its tier: the root's retention, the process group, the lock
    setting, the async mode (None: saves block), the manager's plan cache and its saves'
    `progress=`."""

    retention: RetentionPolicy
    group: Any
    hold_lock: bool
    mode: AsyncMode | None
    plan_cache: PlanCache
    progress: Any = None


class Tier(Protocol):
    """Where steps live. Every method is collective unless it says otherwise."""

    lock: RootLock  # the lock of the manager's root

    def save(self, step: int, state: Mapping[str, Any], metadata, metrics, overwrite: bool) -> SaveResult | AsyncSave:
        """Save and commit `step` (an AsyncSave with an async mode)."""

    def load(
        self, state: Mapping[str, Any], step: int | None, options: dict[str, Any], *, fresh_start_ok: bool = False
    ) -> LoadResult | None:
        """Load `step` (None: the newest committed) into `state`; None when there is nothing to
        resume. `fresh_start_ok`: nothing to resume may be returned even where a tier cannot
        tell that nothing exists (its remote unreachable); otherwise that is an error."""

    def latest(self) -> int | None:
        """The step `load` would resume from."""

    def steps(self) -> list[int]:
        """Committed steps, oldest first (no collective)."""

    def path(self, step: int) -> str:
        """The URI of `step`'s directory (no collective)."""

    def gc(self, *, dry_run: bool, on_removed: Callable[[int, int], None] | None) -> list[str]:
        """Retention and debris removal now: the step directories (to be) removed."""

    def wait(self, timeout: float | None = None, *, catch_up: str | None = None) -> Any:
        """Wait for the tier's own background work: its result, its failure raised once, None if
        none. `catch_up` ("wait()", "close()"): the user's call, which also sends what a later
        save would have sent (collective then)."""

    def busy(self) -> bool:
        """Whether background work is in flight (no collective)."""

    def close(self) -> None:
        """Release what this process holds (no collective)."""

    def describe(self) -> str:
        """The tier in a manager's repr: its root's URI, and what else it writes to."""

    def remote_lag(self) -> Any:
        """The steps a remote lacks for want of it (`remote_lag.RemoteLagReport`; no
        collective); None for a tier without a remote."""

    def local_usage(self) -> Any:
        """What this rank's root holds on its filesystem (`local_budget.LocalUsage`; no
        collective); None for a root that is not a local directory."""


class SingleRoot:
    """One root every rank sees (a shared filesystem or an object store): the manager's own
    lock, `latest` pointer and retention."""

    def __init__(self, storage: Storage, uri: str, settings: TierSettings):
        self.storage = storage
        self.uri = uri  # the root as the user named it, for messages
        self.settings = settings
        self.lock = RootLock(storage, hold=settings.hold_lock)

    def describe(self) -> str:
        return repr(self.uri)

    def remote_lag(self) -> None:
        return None

    def local_usage(self) -> LocalUsage | None:
        path = self.storage.local_path()
        return None if path is None else usage(path, None, self.storage)

    def path(self, step: int) -> str:
        return f"{self.storage.uri.rstrip('/')}/{step_dir(step)}"

    def steps(self) -> list[int]:
        return committed_steps(self.storage)

    def latest(self) -> int | None:
        step, warning = _dist.decide_on_rank0(lambda: resolve_latest(self.storage, self.uri), self.settings.group)
        if warning:
            _dist.warn_once(warning, StalePointerWarning, self.settings.group)
        return step

    def save(self, step: int, state: Mapping[str, Any], metadata, metrics, overwrite: bool) -> SaveResult | AsyncSave:
        """A save into this root under its lock; the transaction publishes `latest` and applies
        retention once it committed (in the background with an async mode)."""
        group = self.settings.group
        _dist.decide_on_rank0(self.lock.take, group)
        try:
            replace = (
                None
                if overwrite
                else _dist.decide_on_rank0(lambda: replace_reason(self.storage, self.uri, step), group)
            )
            if replace:
                _dist.warn_once(replace, StalePointerWarning, group)
            return transact(
                self.storage.child(step_dir(step)),
                state,
                step=step,
                metadata=metadata,
                metrics=metrics,
                overwrite=overwrite or bool(replace),
                group=group,
                mode=self.settings.mode,
                after_commit=lambda: self._publish(step),
                on_failure=self._abandon,
                plan_cache=self.settings.plan_cache,
                progress=self.settings.progress,
                fence=lambda what: self.lock.fence(f"{what} step {step}"),
            )
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """After a failed save: rank 0 lets go of the lock (unless held)."""
        if _dist.get_rank(self.settings.group) == 0:
            self.lock.abandon()

    def _publish(self, step: int) -> None:
        """Rank 0, once `step` committed: move `latest` to it, then retention."""
        try:
            self.lock.fence(f"move latest to step {step}")
            self.storage.set_pointer(LATEST, step_dir(step))
            self._collect(protect={step})
        except BaseException:
            self.lock.abandon()
            raise
        self.lock.done()

    def _collect(self, protect: set[int], dry_run: bool = False, on_removed=None) -> list[str]:
        """Retention and debris removal (`ckptlib.manager.cleanup`); never removes what `latest`
        names or `protect`."""
        return collect(
            self.storage,
            self.uri,
            self.settings.retention,
            protect=protect,
            dry_run=dry_run,
            on_removed=on_removed,
            fence=None if dry_run else self.lock.fence,
        )

    def gc(self, *, dry_run: bool, on_removed) -> list[str]:
        group = self.settings.group
        world = _dist.get_world_size(group)

        def run() -> list[str]:
            started = time.perf_counter()
            sizes = {info.name: sum(info.files.values()) for info in scan(self.storage)}
            if dry_run:
                removed = self._collect(protect=set(), dry_run=True)
            else:
                self.lock.take()
                try:
                    removed = self._collect(protect=set(), on_removed=on_removed)
                finally:
                    self.lock.done()
            log_operation(
                "gc",
                uri=self.uri,
                step=None,
                nbytes=sum(sizes.get(name, 0) for name in removed),
                seconds=time.perf_counter() - started,
                world_size=world,
                removed=len(removed),
                dry_run=dry_run,
            )
            return removed

        return _dist.decide_on_rank0(run, group)

    def load(
        self, state: Mapping[str, Any], step: int | None, options: dict[str, Any], *, fresh_start_ok: bool = False
    ) -> LoadResult | None:
        """`step`, or the newest committed one (retried on the new `latest` if retention removes
        it meanwhile); None when the root has no committed step (one root knows that for sure,
        so `fresh_start_ok` changes nothing)."""
        latest = self.latest if step is None else None
        if step is None:
            step = self.latest()
            if step is None:
                return None
        step, result = load_step(
            self.storage, self.uri, state, step, latest=latest, group=self.settings.group, options=options
        )
        if result.step is None:  # a step directory written without step= (`ckpt convert ... root/step_N`)
            result.step = step
        return result

    def wait(self, timeout: float | None = None, *, catch_up: str | None = None) -> None:
        return None  # a single root runs nothing beyond the manager's own async save

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        self.lock.close()


__all__ = ["SingleRoot", "Tier", "TierSettings"]
