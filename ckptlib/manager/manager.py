"""CheckpointManager: one directory per step, one `latest` pointer, retention, autoresume.

The pointer is written once, by rank 0, only after the step committed, and read by all
ranks; never one pointer per rank (per-rank pointers went stale after a resize in
mosaicml/composer#2409).

Writers lock the root: rank 0 creates `ckptlib.lock` (atomically, through the storage's
optional `create_exclusive`) before a save or gc and removes it afterwards, or keeps it
until `close()` with `hold_lock=True`; every rank learns the outcome, so a second writer
gets LockedError on all its ranks instead of interleaving checkpoints (and retention never
deletes a step another writer is still saving; the verl project fixed that bug, #4638). A
lock whose holder is gone (a dead pid on this host, or a lease its holder stopped renewing,
on any host: `ckptlib.manager.lock`) is removed with a StaleLockWarning, so a crashed save
never leaves the root locked for good. A writer that lost its lock meanwhile (paused past its
lease while another writer took the root) refuses its next irreversible step (a commit,
moving `latest`, a deletion, the release) with LockedError: `RootLock.fence`.

Where steps live is the tier the manager holds (`single_root.SingleRoot`, or the cluster
tier of `cluster=`): the manager adds the save policy, preemption, async handles and the
initial load around it and never asks which tier it holds.

Crash consistency: a step directory counts only once its manifest is committed; anything
else under `step_*` (a crashed save, a half-finished deletion) is debris that `latest`
never names and that the next save or gc removes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from typing import Any, Mapping

from ckptlib._runtime import agree as _dist
from ckptlib._runtime import progress as progress_bars
from ckptlib._runtime import world
from ckptlib.errors import StateError
from ckptlib.format.native.root import check_step, committed_steps
from ckptlib.format.write.plan_cache import PlanCache
from ckptlib.loading.loading import LoadResult
from ckptlib.manager import policies as _save_policy
from ckptlib.manager.arguments import same_arguments
from ckptlib.manager.fresh_start import FreshStartWarning, fresh_start_message, fresh_start_reason, nothing_to_resume
from ckptlib.manager.lock import LockHolder
from ckptlib.manager.options import Cluster, InitialLoad, Preemption, check_retention, make_tier
from ckptlib.manager.policies import RetentionPolicy, SaveContext, SavePolicy, decide
from ckptlib.manager.preemption import PreemptionWatcher, check_agent_store, exit_code_after_preemption, signal_name
from ckptlib.manager.root_load import load_initial
from ckptlib.manager.single_root import TierSettings
from ckptlib.saving import background_save
from ckptlib.saving.async_mode import AsyncMode
from ckptlib.saving.saving import SaveResult
from ckptlib.state.state_checks import check_manager_call
from ckptlib.storage import open_storage
from ckptlib.storage.base import Storage


class CheckpointManager:
    """Saves numbered checkpoints under `root` and resumes from the newest committed one.

    With `cluster=Cluster(...)`, `root` is this node's local root and the manager holds a
    cluster tier (`ckptlib.manager.cluster.cluster_tier`): node-local saves, peer replicas, per-rank uploads."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int | None = None,
        retention: RetentionPolicy | None = None,
        save_policy: SavePolicy | None = None,
        async_save: bool | AsyncMode = False,
        cluster: Cluster | None = None,
        preemption: bool | Preemption = False,
        initial_load: str | os.PathLike | InitialLoad | None = None,
        process_group=None,
        hold_lock: bool = False,
        progress: Any = None,
    ):
        """`retention`: a policy from `ckptlib.manager.policies` (`KeepLast(3) | KeepBest(2, "loss")`);
        `keep_last=N` is short for `KeepLast(N)`. `save_policy` decides when `maybe_save` saves.

        `async_save=True` (or an `AsyncMode`): `save()` returns an `AsyncSave` handle once the
        state is staged; the write, the commit, moving `latest` and retention run in the
        background (on a dedicated gloo group, never the caller's). The next `save()`, `gc()`,
        `wait()` and `close()` wait for it first, and raise its failure if it failed (on every
        rank); a failed save never moves `latest`. At interpreter exit the save in flight is
        waited for before the lock is released. The shards are written by a writer process per
        rank, from shared memory, started here (it imports torch while the model is built;
        `close()` stops it): the default where memfd exists, `AsyncMode("process")`; or by the
        background thread, `AsyncMode("thread")`. `AsyncMode(background_staging=True)`: `save()`
        returns before the state is copied; `AsyncMode(max_staging_bytes=N)`: at most N bytes of
        staging copies (see `ckptlib.async_save`).

        `cluster`: node-local roots, peer replicas and a remote (`Cluster`, docs/tier.md);
        `retention`/`keep_last` keep this node's root. `preemption=True` (or a `Preemption`
        naming the signals): a handler records SIGTERM/SIGUSR1 and the next `maybe_save` saves
        on every rank. `initial_load`: a checkpoint that `load()` reads when the root has no
        committed step yet (an `InitialLoad` to choose the state entries it fills).

        `hold_lock=False`: the root is locked during each save and gc. `hold_lock=True`: the
        first save or gc takes the lock and keeps it until `close()` (or the end of a `with`
        block, or interpreter exit), so no other writer can use the root between saves.

        `progress`: the saves' and loads' progress as `ckptlib.save` shows it (None: a bar on
        stderr when it is a terminal; True, False, or `fn(op, done, total)`), rank 0 only; a
        load's own `progress=` wins.

        `process_group=None` (the default group) follows the process into a new world
        (`destroy_process_group()`, then `init_process_group()`; `wait()` before the destroy);
        a manager made with an explicit group keeps it, and once its world is gone every
        collective call raises ProcessGroupError: make a new manager with a group of the new world."""
        progress_bars.check(progress)
        self.progress = progress
        self.retention = check_retention(keep_last, retention, save_policy)
        self.mode = AsyncMode.of(async_save)
        self.preemption = Preemption.of(preemption)
        self.initial_load = InitialLoad.of(initial_load)
        if cluster is not None and not isinstance(cluster, Cluster):
            raise StateError(f"cluster must be a ckptlib.Cluster, got {type(cluster).__name__} {cluster!r}")
        self.root_uri = os.fspath(root)
        self.storage: Storage = open_storage(self.root_uri)
        self.save_policy = save_policy
        self.process_group = process_group
        self.hold_lock = hold_lock
        self.initial_loaded = False  # True after load() read initial_load (the root had no step)
        self.last_load: LoadResult | None = None  # what the last load() restored (None: nothing to resume)
        self.preempted = False  # set by maybe_save once a preemption signal reached any rank
        self.preemption_signal: str | None = None  # its name ("SIGTERM"), the same on every rank
        self._watcher = PreemptionWatcher(self.preemption.signals) if self.preemption is not None else None
        check_agent_store()  # under torchrun: restarts that would read a previous attempt's gloo addresses
        self._last_save_step: int | None = None
        self._last_save_time = _save_policy.clock()
        if self.mode is not None:
            self.mode.start_writer()  # a process writer imports torch while the training sets up
        self._pending = None  # the AsyncSave in flight (async_save)
        _dist.start_heartbeat()  # a rank that never calls save tells a roll call it is alive
        settings = TierSettings(self.retention, process_group, hold_lock, self.mode, PlanCache(), progress)
        self.tier = make_tier(self.storage, self.root_uri, settings, cluster)
        self.remote = None if cluster is None else cluster.remote

    def __repr__(self) -> str:
        return f"CheckpointManager({self.tier.describe()})"

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self._close(catch_up="close()" if exc_type is None else None)  # after an error: no collective

    def close(self) -> None:
        """Wait for an async save in flight (raising its failure), stop the writer process
        (AsyncMode("process")), then release the root's lock if this manager holds it (rank 0;
        no collective): LockedError when the lock was lost while held (another writer took the
        root; its lock file stays). With a cluster tier whose remote lacks the newest step (left
        local for want of the remote), that step is uploaded first (collective), or a
        RemoteLagError naming it is raised: no later save will upload it."""
        self._close(catch_up="close()")

    def _close(self, catch_up: str | None) -> None:
        try:
            self._wait(None, catch_up=catch_up)
        finally:
            if self._watcher is not None:
                self._watcher.close()
            if self.mode is not None and self.mode.writer_here() == "process":
                background_save.release_staging(shared_only=True)  # the writer process and its memory
            self.tier.close()

    # -- async saves --------------------------------------------------------------------
    @property
    def preempted_here(self) -> bool:
        """Whether this process itself received a preemption signal (not only a peer)."""
        return self._watcher is not None and self._watcher.seen is not None

    def preemption_exit_code(self) -> int:
        """The exit status for a rank that stops after `preempted`: 0, except under torchrun's
        elastic agent with restarts left on a rank whose host was not signalled, which returns
        `RESTART_EXIT_CODE` (75) so its agent restarts it at the new world size
        (`ckptlib.manager.preemption.exit_code_after_preemption`)."""
        return exit_code_after_preemption(self.preempted_here)

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the async save in flight, if any: its SaveResult, or its failure raised
        unless it was already raised elsewhere (by the handle's wait()/result(), or an earlier
        call here): a failure is delivered once and the next call starts clean. None when
        nothing was in flight; TimeoutError when it is still running after `timeout` seconds.
        With a cluster tier: the replicas and the upload too (the remote copy's SaveResult); when
        the upload of the newest step was skipped within the wait after a remote failure, it is
        tried now (collective), a failure warned of as at a save."""
        return self._wait(timeout, catch_up="wait()")

    def _wait(self, timeout: float | None = None, *, catch_up: str | None = None) -> SaveResult | None:
        """`wait`; the manager's own calls (before a save, a load, gc) catch up on nothing."""
        pending, result = self._pending, None
        try:
            if pending is not None:
                result = pending.deliver(timeout)
            return self.tier.wait(timeout, catch_up=catch_up) or result
        finally:
            if pending is not None and pending.done():
                self._pending = None
            if self._pending is None and not self.tier.busy():
                atexit.unregister(self._wait_at_exit)

    def _wait_at_exit(self) -> None:
        # Registered after the lock's own exit handler, so it runs first (atexit is LIFO):
        # the lock is never released while the background still writes under it.
        with contextlib.suppress(Exception):
            self._wait()

    # -- the lock -----------------------------------------------------------------------
    def lock_holder(self) -> LockHolder | None:
        """Who holds the root's lock now, or None."""
        return self.tier.lock.holder()

    def check_lock(self) -> None:
        """Raise the LockedError a gc or save would raise now (another live writer holds the
        root's lock), without taking it: what `ckpt gc --dry-run` reports."""
        _dist.decide_on_rank0(self.tier.lock.check, self.process_group)

    def break_lock(self) -> LockHolder | None:
        """Remove the root's lock whoever holds it; returns the holder it named (or None).

        Only for a writer known to be gone (a crashed job on another host): breaking the lock
        of a live writer lets two writers interleave.
        """
        world.check_group(self.process_group, f"break_lock of {self.root_uri}")
        with _dist.called_by_every_rank("manager.break_lock", f"break_lock of {self.root_uri}", self.process_group):
            return _dist.decide_on_rank0(self.tier.lock.break_, self.process_group)

    # -- reading the root -------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first (with a remote: the remote root's)."""
        return self.tier.steps()

    def local_steps(self) -> list[int]:
        """Committed steps under this manager's own root (with a cluster tier: this node's), oldest first."""
        return committed_steps(self.storage)

    def latest(self) -> int | None:
        """The step `load()` would resume from, or None when the root has no checkpoint. Collective."""
        world.check_group(self.process_group, f"latest of {self.root_uri}")
        with _dist.called_by_every_rank(
            "manager.latest", f"latest of {self.root_uri}", self.process_group, path=self.root_uri
        ):
            return self.tier.latest()

    @property
    def remote_lag(self):
        """With a remote: the saved steps it lacks because it was unreachable, how long since
        the oldest of them, the last failure (a `RemoteLagReport`; empty when up to date). None
        without a remote. See `Cluster(remote_lag=RemoteLag(...))` for making it an error."""
        return self.tier.remote_lag()

    def local_usage(self):
        """What this rank's root holds (`LocalUsage`: bytes held, the newest step's size, the
        limit, free bytes, the filesystem and whether it is memory); None for a root that is
        not a local directory. No collective."""
        return self.tier.local_usage()

    def path(self, step: int) -> str:
        return self.tier.path(step)

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
        all_reduce per call (which also checks that every rank passed the same `step`:
        RanksDisagreeError on every rank otherwise), then the save if any.

        After a preemption signal the save is synchronous (an async save in flight is waited
        for too), and `preempted` becomes True on every rank: the loop should stop. A step this
        manager already saved or loaded is not saved again."""
        check_manager_call("maybe_save", self.root_uri, state, step)
        step = check_step(step)
        world.check_group(self.process_group, f"maybe_save of step {step} to {self.root_uri}")
        watcher = self._watcher
        policy = self.save_policy

        def ask_policy() -> bool:
            if policy is None:
                return False
            return policy.should_save(
                SaveContext(step, _save_policy.clock(), self._last_save_time, self._last_save_step)
            )

        decision = decide(
            ask_policy, force=force, signal=watcher and watcher.received, group=self.process_group, step=step
        )
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
        a crash during that save leaves `latest` falling back to the newest other committed step.

        Collective: every rank passes the same `step` and `overwrite` (RanksDisagreeError on
        every rank otherwise, before anything is written)."""
        check_manager_call("save", self.root_uri, state, step)
        step = check_step(step)
        what = f"save of step {step} to {self.root_uri}"
        with _dist.called_by_every_rank("manager.save", what, self.process_group, step=step, path=self.path(step)):
            with _dist.peer_loss_as_error(what, self.process_group, step=step, path=self.path(step)):
                same_arguments("save", self.process_group, step=step, overwrite=overwrite)
            self._wait()  # the previous async save: its failure surfaces here, before anything else
            with _dist.peer_loss_as_error(what, self.process_group, step=step, path=self.path(step)):
                return self._save(step, state, metadata, metrics, overwrite)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        metadata: dict[str, Any] | None,
        metrics: dict[str, float] | None,
        overwrite: bool,
    ) -> SaveResult:
        result = self.tier.save(step, state, metadata, metrics, overwrite)
        if self.mode is not None or self.tier.busy():  # waited for at exit too
            self._pending = result if self.mode is not None else None
            atexit.register(self._wait_at_exit)
        self._last_save_step, self._last_save_time = step, _save_policy.clock()
        return result

    def gc(self, *, dry_run: bool = False, on_removed=None) -> list[str]:
        """Apply retention and remove debris now; returns the step directories (to be) removed.
        `on_removed(done, total)` is called on rank 0 as directories are removed.

        Takes the root's lock (LockedError while another writer holds it), except for a dry run.
        Collective: every rank passes the same `dry_run` (RanksDisagreeError otherwise).
        """
        world.check_group(self.process_group, f"gc of {self.root_uri}")
        what = f"gc of {self.root_uri}"
        with _dist.called_by_every_rank("manager.gc", what, self.process_group, path=self.root_uri):
            with _dist.peer_loss_as_error(what, self.process_group, path=self.root_uri):
                same_arguments("gc", self.process_group, dry_run=dry_run)
            self._wait()  # never delete while a save is still writing (verl #4638)
            return self.tier.gc(dry_run=dry_run, on_removed=on_removed)

    # -- loading ------------------------------------------------------------------------
    def load(
        self,
        state: Mapping[str, Any],
        step: int | None = None,
        *,
        require: bool = False,
        fresh_start_ok: bool = False,
        **kwargs: Any,
    ) -> int | None:
        """Load `step` (None: the newest committed) into `state` and return the step resumed
        from: None when there is nothing to resume, 0 after an `initial_load` (train from step
        0). Takes `load`'s options (`strict`, `only`, `ignore_keys`, `rename`...). The whole
        LoadResult is `last_load` afterwards (its `uri` names the initial_load checkpoint when
        that was loaded).

        Nothing to resume at a root that does not exist (or is empty beside other runs'
        roots) is a FreshStartWarning naming it; `require=True` makes any fresh start a
        CheckpointNotFoundError. With a cluster tier, a remote that cannot be read while no
        node holds a step is a RemoteUnavailableError (a committed step may exist there)
        unless `fresh_start_ok=True`. Collective: every rank passes the same `step` (None on all,
        or one step), `require` and `fresh_start_ok` (RanksDisagreeError on every rank otherwise,
        before anything is read)."""
        check_manager_call("load", self.root_uri, state)
        chosen = None if step is None else check_step(step)
        kwargs.setdefault("progress", self.progress)
        what = f"load from {self.root_uri}"
        with _dist.called_by_every_rank("manager.load", what, self.process_group, path=self.root_uri):
            with _dist.peer_loss_as_error(what, self.process_group, path=self.root_uri):
                # before the tier picks its collectives; and so no rank raises alone for want of a step
                same_arguments("load", self.process_group, step=chosen, require=require, fresh_start_ok=fresh_start_ok)
            self._wait()  # a save or upload in flight: its failure surfaces before anything else
            result = self.tier.load(state, chosen, kwargs, fresh_start_ok=fresh_start_ok)
        if result is None and self.initial_load is not None:
            result = load_initial(self.initial_load.path, self.initial_load.only, state, self.process_group, kwargs)
            self.initial_loaded = True
            self.last_load = result
            return 0
        self.last_load = result
        if result is None:
            self._fresh_start(require)
            return None
        self._last_save_step = result.step  # maybe_save does not save this step again
        self.initial_loaded = False
        return result.step

    def _fresh_start(self, require: bool) -> None:
        """Nothing to resume: an error with `require`, a warning where the root looks mistyped
        (decided on rank 0, so every rank raises or warns alike)."""
        reason, suspicious = _dist.decide_on_rank0(
            lambda: fresh_start_reason(self.storage, self.root_uri), self.process_group
        )
        if require:
            raise nothing_to_resume(self.root_uri, reason)
        if suspicious:  # decided on rank 0: said once per job
            _dist.warn_once(fresh_start_message(self.root_uri, reason), FreshStartWarning, self.process_group)


__all__ = ["CheckpointManager"]
