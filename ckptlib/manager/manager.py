"""CheckpointManager: one directory per step, one `latest` pointer, retention, autoresume.

The pointer is written once, by rank 0, only after the step committed, and read by all
ranks; never one pointer per rank (per-rank pointers went stale after a resize in
mosaicml/composer#2409).

Writers lock the root: rank 0 creates `ckptlib.lock` (atomically, through the storage's
optional `create_exclusive`) before a save or gc and removes it afterwards, or keeps it
until `close()` with `hold_lock=True`; every rank learns the outcome, so a second writer
gets LockedError on all its ranks instead of interleaving checkpoints (and retention never
deletes a step another writer is still saving; the verl project fixed that bug, #4638). A
lock whose holder is gone (a dead pid on this host) is removed with a StaleLockWarning, so
a crashed save never leaves the root locked for good; a holder on another host must be
removed explicitly (`break_lock()`, `ckpt unlock`).

Crash consistency: a step directory counts only once its manifest is committed; anything
else under `step_*` (a crashed save, a half-finished deletion) is debris that `latest`
never names and that the next save or gc removes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

from ckptlib._runtime import agree as _dist
from ckptlib._runtime.observe import log_operation
from ckptlib.errors import CheckpointError, stacklevel_outside_ckptlib
from ckptlib.format.native.root import (
    LATEST,
    StalePointerWarning,
    StepInfo,
    check_step,
    committed_steps,
    parse_step,
    replace_reason,
    resolve_latest,
    scan,
    step_dir,
)
from ckptlib.format.write.plan_cache import PlanCache
from ckptlib.loading.loading import LoadResult
from ckptlib.manager import policies as _save_policy
from ckptlib.manager.cleanup import ForeignFilesWarning, collect
from ckptlib.manager.cluster.cluster_tier import ClusterTier
from ckptlib.manager.cluster.remote_tier import RemoteTier
from ckptlib.manager.lock import LOCK_NAME, LockHolder, RootLock, StaleLockWarning
from ckptlib.manager.manager_options import check_options
from ckptlib.manager.policies import KeepLast, RetentionPolicy, SaveContext, SavePolicy, decide
from ckptlib.manager.preemption import DEFAULT_SIGNALS, PreemptionWatcher, signal_name
from ckptlib.manager.root_load import load_initial, load_step
from ckptlib.saving import background_save, writer_process
from ckptlib.saving.saving import SaveResult, transact
from ckptlib.storage import open_storage
from ckptlib.storage.base import Storage


class CheckpointManager:
    """Saves numbered checkpoints under `root` and resumes from the newest committed one.

    With `remote=` or `replicas=`, `root` is this node's local root and the manager holds a
    cluster tier (`ckptlib.manager.cluster.cluster_tier`): node-local saves, peer replicas, per-rank uploads."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = None,
        retention: RetentionPolicy | None = None,
        save_policy: SavePolicy | None = None,
        save_on_preemption: bool = False,
        preemption_signals: Iterable[int] = DEFAULT_SIGNALS,
        initial_load: str | os.PathLike | None = None,
        initial_load_only: Sequence[str] | None = None,
        process_group=None,
        hold_lock: bool = False,
        async_save: bool = False,
        background_staging: bool = False,
        remote: str | os.PathLike | RemoteTier | None = None,
        replicas: int = 0,
        node: Any = None,
        remote_root: str | os.PathLike | None = None,
        keep_local: int | None = None,
        upload_concurrency: int | None = None,
        async_mode: str = "thread",
    ):
        """`hold_lock=False`: the root is locked during each save and gc. `hold_lock=True`: the
        first save or gc takes the lock and keeps it until `close()` (or the end of a `with`
        block, or interpreter exit), so no other writer can use the root between saves.

        `async_save=True`: `save()` returns an `AsyncSave` handle once the state is staged; the
        write, the commit, moving `latest` and retention run in the background (on a dedicated
        gloo group, never the caller's). The next `save()`, `gc()`, `wait()` and `close()` wait
        for it first, and raise its failure if it failed (on every rank); a failed save never
        moves `latest`. At interpreter exit the save in flight is waited for before the lock
        is released. `background_staging=True` (with `async_save=True`): `save()` returns
        before the state is copied; call the handle's `wait_staged()` before changing the
        state (see `ckptlib.save`). `async_mode="process"`: the shards are written by a writer
        process per rank, from shared memory (`ckptlib.async_save`), started here; `close()` stops it.

        `retention`: a policy from `ckptlib.manager.policies` (`KeepLast(3) | KeepBest(2, "loss")`);
        `keep_last=N` is short for `KeepLast(N)`. `save_policy` (`ckptlib.manager.policies`) decides
        when `maybe_save` saves. `save_on_preemption=True`: a handler for `preemption_signals`
        records the signal and the next `maybe_save` saves on every rank (see `maybe_save`).
        `initial_load`: a checkpoint (any format ckptlib reads) that `load()` reads when the
        root has no committed step yet; only the state's modules unless `initial_load_only`
        names the state entries to take from it.

        `remote` (a URI or a `RemoteTier`, with its own retention), `replicas`, `node`: the cluster
        tier (`ckptlib.manager.cluster.cluster_tier`, README); `retention`/`keep_last` keep this node's root.
        `remote_root=URI, keep_local=N` (the old spelling): deprecated."""
        self.retention, remote = check_options(
            (keep_last, retention, save_policy, async_save, background_staging, async_mode),
            (remote, remote_root, keep_local, upload_concurrency),
        )
        self.root_uri = os.fspath(root)
        self.storage: Storage = open_storage(self.root_uri)
        self.save_policy = save_policy
        self.initial_load = None if initial_load is None else os.fspath(initial_load)
        self.initial_load_only = None if initial_load_only is None else tuple(initial_load_only)
        self.initial_loaded = False  # True after load() read initial_load (the root had no step)
        self.last_load: LoadResult | None = None  # what the last load() restored (None: nothing to resume)
        self.preempted = False  # set by maybe_save once a preemption signal reached any rank
        self.preemption_signal: str | None = None  # its name ("SIGTERM"), the same on every rank
        self._watcher = PreemptionWatcher(preemption_signals) if save_on_preemption else None
        self._last_save_step: int | None = None
        self._last_save_time = _save_policy.clock()
        self.process_group = process_group
        self.hold_lock = hold_lock
        self.async_save = async_save
        self.background_staging = background_staging
        self.async_mode = async_mode
        if async_mode == "process" and writer_process.check_mode(async_mode) == "process":
            writer_process.writer()  # it imports torch while the training sets up, not at the first save
        self._lock = RootLock(self.storage)
        self._pending = None  # the AsyncSave in flight (async_save=True)
        self._plan_cache = PlanCache()  # this manager's saves reuse their plans (format.plan_cache)
        self.tier = ClusterTier.create(self, remote, replicas, node)
        self.remote = None if self.tier is None else self.tier.remote

    def __repr__(self) -> str:
        if self.remote is not None:
            return f"CheckpointManager({self.root_uri!r}, remote={self.remote.uri!r})"
        return f"CheckpointManager({self.root_uri!r})"

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Wait for an async save in flight (raising its failure), stop the writer process
        (async_mode="process"), then release the root's lock if this manager holds it (rank 0;
        no collective)."""
        try:
            self.wait()
        finally:
            if self._watcher is not None:
                self._watcher.close()
            if self.async_mode == "process":
                background_save.release_staging(shared_only=True)  # the writer process and its memory
            self._lock.release()
            if self.tier is not None:
                self.tier.close()

    # -- async saves --------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the async save in flight, if any: its SaveResult, or its failure raised
        unless it was already raised elsewhere (by the handle's wait()/result(), or an earlier
        call here): a failure is delivered once and the next call starts clean. None when
        nothing was in flight; TimeoutError when it is still running after `timeout` seconds.
        With a cluster tier: the replicas and the upload too (the remote copy's SaveResult)."""
        pending, result = self._pending, None
        try:
            if pending is not None:
                result = pending.deliver(timeout)
            if self.tier is not None:
                result = self.tier.wait(timeout) or result
            return result
        finally:
            if pending is not None and pending.done():
                self._pending = None
            if self._pending is None and (self.tier is None or self.tier._job is None):
                atexit.unregister(self._wait_at_exit)

    def _wait_at_exit(self) -> None:
        # Registered after the lock's own exit handler, so it runs first (atexit is LIFO):
        # the lock is never released while the background still writes under it.
        with contextlib.suppress(Exception):
            self.wait()

    # -- the lock -----------------------------------------------------------------------
    def _take_lock(self) -> None:
        """Rank 0: take the lock, or confirm that a held lock is still ours (`RootLock.take`)."""
        self._lock.take()

    def _drop_lock(self) -> None:
        """Release after a successful save or gc (only warns when it cannot), unless held."""
        if not self.hold_lock:
            self._lock.drop()

    def _drop_lock_after_failure(self) -> None:
        if _dist.get_rank(self.process_group) == 0 and not self.hold_lock:
            with contextlib.suppress(Exception):
                self._lock.release()

    def lock_holder(self) -> LockHolder | None:
        """Who holds the root's lock now, or None."""
        return self._lock.holder()

    def break_lock(self) -> LockHolder | None:
        """Remove the root's lock whoever holds it; returns the holder it named (or None).

        Only for a writer known to be gone (a crashed job on another host): breaking the lock
        of a live writer lets two writers interleave.
        """
        return _dist.decide_on_rank0(self._lock.break_, self.process_group)

    # -- reading the root -------------------------------------------------------------
    def _scan(self) -> list[StepInfo]:
        return scan(self.storage)

    def steps(self) -> list[int]:
        """Committed steps, oldest first (with a remote tier: the remote root's)."""
        if self.remote is not None:
            return self.remote.steps()
        return committed_steps(self.storage)

    def local_steps(self) -> list[int]:
        """Committed steps under this node's root, oldest first."""
        return committed_steps(self.storage)

    def _resolve_latest(self) -> tuple[int | None, str | None]:
        """(step, warning) for the newest usable checkpoint: the pointer if it is valid."""
        return resolve_latest(self.storage, self.root_uri)

    def latest(self) -> int | None:
        """The step `load()` would resume from, or None when the root has no checkpoint."""
        if self.tier is not None:
            return self.tier.latest()
        step, warning = _dist.decide_on_rank0(self._resolve_latest, self.process_group)
        if warning:
            warnings.warn(warning, StalePointerWarning, stacklevel=stacklevel_outside_ckptlib())
        return step

    def path(self, step: int) -> str:
        if self.remote is not None:
            return self.remote.path(step)
        return f"{self.storage.uri.rstrip('/')}/{step_dir(step)}"

    # -- saving -------------------------------------------------------------------------
    def maybe_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Save `step` if the save policy says so (rank 0 decides), `force` is true on any rank, or
        a preemption signal reached any rank; return whether it saved. Collective: one small
        all_reduce per call, then the save if any.

        After a preemption signal the save is synchronous (an async save in flight is waited
        for too), and `preempted` becomes True on every rank: the loop should stop. A step this
        manager already saved or loaded is not saved again."""
        step = check_step(step)
        watcher = self._watcher
        policy = self.save_policy

        def ask_policy() -> bool:
            if policy is None:
                return False
            return policy.should_save(
                SaveContext(step, _save_policy.clock(), self._last_save_time, self._last_save_step)
            )

        decision = decide(ask_policy, force=force, signal=watcher and watcher.received, group=self.process_group)
        if decision.preempted:
            self.preempted = True
            self.preemption_signal = signal_name(decision.signal)
            if watcher is not None:
                watcher.received = None  # handled: a later signal asks for another save
        if not (decision.save or decision.preempted) or step == self._last_save_step:
            if decision.preempted:
                self.wait()
            return False
        self.save(step, state, metadata=metadata, metrics=metrics)
        if decision.preempted:
            self.wait()
        return True

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        overwrite: bool = False,
    ) -> SaveResult:
        """Save and commit `step`, move `latest` to it, then apply retention. `metrics` (rank 0's
        values) are stored in the manifest for `KeepBest` and listings.

        A committed `step` that `latest` does not name (a rollback's abandoned step) is replaced
        with a StalePointerWarning; the step `latest` names is refused (CheckpointExistsError)
        unless `overwrite=True`. Its old files are removed before the new ones are written, so
        a crash during that save leaves `latest` falling back to the newest other committed step."""
        step = check_step(step)
        self.wait()  # the previous async save: its failure surfaces here, before anything else
        with _dist.peer_loss_as_error(
            f"save of step {step} to {self.root_uri}", self.process_group, step=step, path=self.path(step)
        ):
            return self._save(step, state, metadata, metrics, overwrite)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        metadata: dict[str, Any] | None,
        metrics: dict[str, float] | None,
        overwrite: bool,
    ) -> SaveResult:
        if self.tier is not None:  # node-local roots; its background work is waited for at exit too
            result = self.tier.save(step, state, metadata, metrics, overwrite)
        else:
            result = self._save_here(step, state, metadata, metrics, overwrite)
        if self.async_save or self.tier is not None:
            self._pending = result if self.async_save else None
            atexit.register(self._wait_at_exit)
        self._last_save_step, self._last_save_time = step, _save_policy.clock()
        return result

    def _save_here(self, step: int, state, metadata, metrics, overwrite: bool) -> SaveResult:
        """A save into this (shared) root: the manager's own lock, `latest` and retention."""
        target = self.storage.child(step_dir(step))
        _dist.decide_on_rank0(self._take_lock, self.process_group)
        try:
            replace = None if overwrite else _dist.decide_on_rank0(lambda: self._replaceable(step), self.process_group)
            if replace:
                warnings.warn(replace, StalePointerWarning, stacklevel=stacklevel_outside_ckptlib())
            # The save's transaction publishes the step (rank 0, once it committed) and releases
            # the lock if the save fails; with async_save=True both happen in the background.
            result = transact(
                target,
                state,
                step=step,
                metadata=metadata,
                metrics=metrics,
                overwrite=overwrite or bool(replace),
                group=self.process_group,
                asynchronous=self.async_save,
                background_staging=self.background_staging,
                async_mode=self.async_mode,
                after_commit=lambda: self._publish(step),
                on_failure=self._drop_lock_after_failure,
                plan_cache=self._plan_cache,
            )
        except BaseException:
            self._drop_lock_after_failure()
            raise
        return result

    def _replaceable(self, step: int) -> str | None:
        return replace_reason(self.storage, self.root_uri, step)

    def _publish(self, step: int) -> None:
        try:
            self.storage.set_pointer(LATEST, step_dir(step))
            self._collect(protect={step})
        except BaseException:
            if not self.hold_lock:
                with contextlib.suppress(Exception):
                    self._lock.release()
            raise
        self._drop_lock()

    def _collect(self, protect: set[int], dry_run: bool = False, on_removed=None) -> list[str]:
        """Retention and debris removal (`ckptlib.manager.cleanup`); never removes what `latest`
        names or `protect`."""
        return collect(
            self.storage, self.root_uri, self.retention, protect=protect, dry_run=dry_run, on_removed=on_removed
        )

    def gc(self, *, dry_run: bool = False, on_removed=None) -> list[str]:
        """Apply retention and remove debris now; returns the step directories (to be) removed.
        `on_removed(done, total)` is called on rank 0 as directories are removed.

        Takes the root's lock (LockedError while another writer holds it), except for a dry run.
        """
        self.wait()  # never delete while a save is still writing (verl #4638)
        if self.tier is not None:
            return self.tier.gc(dry_run=dry_run, on_removed=on_removed)
        world = _dist.get_world_size(self.process_group)

        def collect() -> list[str]:
            started = time.perf_counter()
            sizes = {info.name: sum(info.files.values()) for info in self._scan()}
            if dry_run:
                removed = self._collect(protect=set(), dry_run=True)
            else:
                self._take_lock()
                try:
                    removed = self._collect(protect=set(), on_removed=on_removed)
                finally:
                    self._drop_lock()
            log_operation(
                "gc",
                uri=self.root_uri,
                step=None,
                nbytes=sum(sizes.get(name, 0) for name in removed),
                seconds=time.perf_counter() - started,
                world_size=world,
                removed=len(removed),
                dry_run=dry_run,
            )
            return removed

        return _dist.decide_on_rank0(collect, self.process_group)

    # -- loading ------------------------------------------------------------------------
    def load(self, state: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> int | None:
        """Load `step` (None: the newest committed) into `state` and return the step resumed
        from: None when there is nothing to resume, 0 after an `initial_load` (train from step
        0). Takes `load`'s options (`strict`, `only`, `ignore_keys`, `rename`...). The whole
        LoadResult is `last_load` afterwards (its `uri` names the initial_load checkpoint when
        that was loaded)."""
        result = self._load_checkpoint(state, step, kwargs)
        self.last_load = result
        if result is None or self.initial_loaded:
            return None if result is None else 0
        if result.step is None:  # a step directory written without step= (`ckpt convert ... root/step_N`)
            result.step = self._last_save_step  # the step loaded, as its directory names it
        return result.step

    def load_result(self, state: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> LoadResult | None:
        """Deprecated: `load(state, ...)`, then `last_load`."""
        warnings.warn(
            "CheckpointManager.load_result() is deprecated; call manager.load(state) and read manager.last_load",
            DeprecationWarning,
            stacklevel=2,
        )
        self.load(state, step, **kwargs)
        return self.last_load

    def _load_checkpoint(self, state: Mapping[str, Any], step: int | None, kwargs: dict[str, Any]) -> LoadResult | None:
        """The load behind `load`: the LoadResult, or None when there is nothing to resume."""
        if self.tier is not None:
            self.wait()  # an upload in flight: its failure surfaces before anything else
            result = self.tier.load(state, None if step is None else check_step(step), kwargs)
            if result is None:
                return self._load_initial(state, kwargs) if self.initial_load is not None else None
            self._last_save_step = result.step
            self.initial_loaded = False
            return result
        latest = self.latest if step is None else None  # resuming: retried on the new latest if it is removed
        if step is None:
            step = self.latest()
            if step is None:
                return self._load_initial(state, kwargs) if self.initial_load is not None else None
        else:
            step = check_step(step)
        step, result = load_step(
            self.storage, self.root_uri, state, step, latest=latest, group=self.process_group, options=kwargs
        )
        self._last_save_step = step  # maybe_save does not save this step again
        self.initial_loaded = False
        return result

    def _load_initial(self, state: Mapping[str, Any], kwargs: dict[str, Any]) -> LoadResult:
        """The root has no committed step: load `initial_load` (by default only the state's modules)."""
        result = load_initial(self.initial_load, self.initial_load_only, state, self.process_group, kwargs)
        self.initial_loaded = True
        return result


__all__ = [
    "CheckpointManager",
    "ForeignFilesWarning",
    "KeepLast",
    "LATEST",
    "StepInfo",
    "LockHolder",
    "StaleLockWarning",
    "StalePointerWarning",
    "step_dir",
    "parse_step",
    "CheckpointError",
    "LOCK_NAME",
]
