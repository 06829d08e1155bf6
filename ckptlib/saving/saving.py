"""`save` and `async_save`: collective, elastic, committed-or-nothing checkpoints.

Every rank calls them (or a single process without a process group). The arguments and the
state are checked in one agreement round, then one `SaveTransaction` (`format.transaction`)
writes and commits the checkpoint inside DCP's own collectives: now (`save`), or in a
background thread on a dedicated gloo group once the state is staged (`async_save`, see
`ckptlib.saving.background_save`). Errors are raised on every rank alike, and a failed save never
touches a committed checkpoint. `transact` is that one path; CheckpointManager calls it with
its hooks (publish after the commit, release the lock after a failure).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Mapping

import torch.distributed.checkpoint as dcp

from ckptlib._runtime import agree as _dist
from ckptlib._runtime import progress as progress_bars
from ckptlib._runtime.gc_pause import gc_paused
from ckptlib._runtime.observe import log_operation, mib_per_s
from ckptlib._torch import dcp_shims
from ckptlib.format.native.manifest import check_metadata_json, check_metrics
from ckptlib.format.native.root import check_step
from ckptlib.format.write import plan_cache as plan_caches
from ckptlib.format.write.plan_cache import PlanCache, PlanReuse
from ckptlib.format.write.save_planner import CkptSavePlanner
from ckptlib.format.write.transaction import SaveTransaction
from ckptlib.saving import background_save, capped_staging, rank_checks
from ckptlib.saving.async_mode import AsyncMode
from ckptlib.saving.background_save import AsyncSave
from ckptlib.state.state import to_save_state_dict
from ckptlib.state.state_checks import check_call
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage


@dataclasses.dataclass
class SaveResult:
    """What a save committed: its size (every file), the saving world size, how long it took
    (`seconds`, for an async save from the call to the commit) and, for an async save, how
    long the caller was blocked (`blocked_seconds`; None for a synchronous save).

    Planning: `planning_seconds` is this rank's own planning work (not the collectives'
    waits), `global_plan_seconds` the coordinator's global plan (the same on every rank), and
    `plan_reused` whether the save reused the plans of the previous save of the same
    structure (`ckptlib.format.write.plan_cache`) instead of planning.

    `staging_peak_bytes` (async saves): the most bytes of staging copies this rank held at once
    (the whole staged shard; with `AsyncMode(max_staging_bytes=N)` at most N); None for a
    synchronous save."""

    uri: str
    step: int | None
    world_size: int
    total_bytes: int
    seconds: float = 0.0
    blocked_seconds: float | None = None
    planning_seconds: float | None = None
    global_plan_seconds: float | None = None
    plan_reused: bool = False
    staging_peak_bytes: int | None = None

    @property
    def bytes(self) -> int:
        return self.total_bytes

    @property
    def mib_per_s(self) -> float | None:
        return mib_per_s(self.total_bytes, self.seconds)


def save(
    uri: str | os.PathLike | Storage,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    overwrite: bool = False,
    process_group=None,
    progress: Any = None,
) -> SaveResult:
    """Save `state` as a sharded DCP checkpoint at `uri` and commit it with a manifest.

    Collective: every rank of `process_group` calls it with its own shard of the state.
    `metrics` (name -> number, rank 0's values) go into the manifest for retention
    (`KeepBest`) and listings; NaN and infinities are stored as null.
    For a save that returns once the state is staged, see `async_save`. `progress`: a bar on
    stderr (None: when it is a terminal; True, False) or `fn(op, done, total)`, on rank 0
    (`ckptlib._runtime.progress`).
    """
    check_call("save", uri, state)
    return transact(
        as_storage(uri),
        state,
        step=step,
        metadata=metadata,
        metrics=metrics,
        overwrite=overwrite,
        group=process_group,
        progress=progress,
    )


def async_save(
    uri: str | os.PathLike | Storage,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    overwrite: bool = False,
    process_group=None,
    background_staging: bool = False,
    async_mode: str = "auto",
    max_staging_bytes: int | None = None,
    progress: Any = None,
) -> AsyncSave:
    """`save`, returning an `AsyncSave` handle as soon as the state is staged to CPU memory;
    the write and the commit run in a background thread on a dedicated gloo group (see
    `ckptlib.saving.background_save`). `handle.wait()` returns the SaveResult or raises the failure.

    `async_mode="process"` (`AsyncMode`'s writer): the state is staged in shared memory and the shard is encoded,
    checksummed, written and fsynced by a long-lived writer process of this rank (one per
    process, started by the first such save and reused by every later one), so the write does
    not compete with the training loop for the GIL; planning and the commit stay in the
    background thread, failures are raised as in thread mode (`ckptlib.saving.writer_process`).
    Where it cannot work (no memfd: not Linux) it falls back to "thread" with a RuntimeWarning.
    `"thread"`: the shard is written by the background thread itself. `"auto"` (the default):
    "process" where memfd exists, else "thread" (silently).

    `max_staging_bytes=N`: never more than N bytes of staging copies; the tensors are copied
    and written in pieces of at most N (`ckptlib.saving.capped_staging`), and the call returns
    once the last piece is copied. A tensor larger than N: StagingCapError, before anything is written.

    `background_staging=True`: return before the staging copy, which then runs first in the
    background. Nothing may change the state until `handle.wait_staged()` returned: not an
    optimizer step, and not a forward pass in training mode that updates buffers (BatchNorm's
    running statistics). Without such buffers, calling it right before `optimizer.step()`
    lets the device-to-host copy overlap forward and backward on a GPU.
    """
    check_call("async_save", uri, state)
    return transact(
        as_storage(uri),
        state,
        step=step,
        metadata=metadata,
        metrics=metrics,
        overwrite=overwrite,
        group=process_group,
        mode=AsyncMode(async_mode, background_staging, max_staging_bytes),
        progress=progress,
    )


def transact(
    storage: Storage,
    state: Mapping[str, Any],
    *,
    step: int | None,
    metadata: dict[str, Any] | None,
    metrics: dict[str, float] | None,
    overwrite: bool,
    group,
    mode: AsyncMode | None = None,
    after_commit: Callable[[], None] | None = None,
    on_failure: Callable[[], None] | None = None,
    make_transaction: Callable[..., SaveTransaction] = SaveTransaction,
    plan_cache: PlanCache | None = None,
    progress: Any = None,
    fence: Callable[[str], None] | None = None,
) -> SaveResult | AsyncSave:
    """The one save path: check the arguments and collect the state (one agreement round,
    which also decides whether the plans of `plan_cache` are reused: by default the
    module-level cache of this group and storage kind), then run a SaveTransaction with the
    hooks (see `format.transaction.SaveTransaction`), now or, with an async `mode`, in the
    background (an AsyncSave handle; its hooks run there), its shards written there or by this
    rank's writer process (`AsyncMode("process")`). `make_transaction`: the transaction's
    class (the cluster tier's `NodeLocalSave`), called with SaveTransaction's arguments;
    `progress` as `save` takes it; `fence` the transaction's (a lock holder's check before each
    irreversible step)."""
    started = time.perf_counter()
    progress_bars.check(progress)
    _dist.check_every_rank_calls("save", _saving(storage, step), group, step=step, path=storage.uri)
    writer = None
    asynchronous = mode is not None
    background_staging = asynchronous and mode.background_staging
    cap = mode.max_staging_bytes if asynchronous else None
    if asynchronous:
        writer = mode.start_writer()  # started now: it imports torch while the state is staged
        background_save.wait_inflight(group)  # one background save per group at a time
        bg_group = background_save.async_group(group)
    arena = writer.arena if writer is not None else None
    rank, world = _dist.get_rank(group), _dist.get_world_size(group)
    stage = asynchronous and not background_staging and cap is None  # a capped save stages as it writes
    if plan_cache is None:
        plan_cache = plan_caches.shared(plan_caches.group_ranks(group), type(storage))
    reuse = plan_caches.PlanReuse(plan_cache, group)
    vote = None if background_staging else reuse  # else voted on the staged copy, in the background
    with _dist.peer_loss_as_error(_saving(storage, step), group, step=step, path=storage.uri):
        (user_metadata, user_metrics, step), state_dict = _dist.agree(
            lambda: _check_and_collect(
                state,
                step,
                metadata,
                metrics,
                group,
                stage=stage,
                cap=cap,
                arena=arena,
                vote=vote,
                where=storage.uri,
                overwrite=overwrite,
            ),
            group,
            ballot=vote,
        )
    backend, ring = writer, None
    if cap is not None:
        background_save.release_pools(group)  # the cap bounds everything this group's saves hold
        ring = capped_staging.ring_for(group, cap, capped_staging.tensor_sizes(state_dict), arena)
        backend = capped_staging.CappedShards(ring, lambda: handle.mark_staged(), writer)
    transaction = make_transaction(
        storage,
        world_size=world,
        step=step,
        metadata=user_metadata,
        metrics=user_metrics,
        overwrite=overwrite,
        after_commit=after_commit,
        on_failure=on_failure,
        shard_backend=backend,
        **({} if fence is None else {"fence": fence}),
    )
    if not asynchronous:
        with progress_bars.reporting("save", storage.uri, progress, rank):
            result = _write(transaction, state_dict, group, reuse)
        result.seconds = time.perf_counter() - started
        _log_save(result, rank)
        return result

    def work() -> SaveResult:
        nonlocal state_dict
        if background_staging and ring is not None:  # staged while written: only the vote here
            state_dict = _dist.agree(lambda: _voted(reuse, state_dict), bg_group, reuse)
        elif background_staging:
            # Every rank learns of a copy that failed on one (on the background's group).
            state_dict = _dist.agree(
                lambda: _voted(reuse, background_save.stage(state_dict, group, arena)), bg_group, reuse
            )
            handle.mark_staged()
        staged_bytes = None if ring is not None else sum(capped_staging.tensor_sizes(state_dict).values())
        # Preparing the target (removing debris) waits for the disk, so it runs in the
        # background too, still before any shard is written; its errors
        # (CheckpointExistsError) come from wait().
        with progress_bars.reporting("save", storage.uri, progress, rank):
            result = _write(transaction, state_dict, bg_group, reuse)
        result.seconds = time.perf_counter() - started
        result.blocked_seconds = (
            handle.staged_seconds if ring is not None and not background_staging else handle.blocking_seconds
        )
        result.staging_peak_bytes = ring.peak if ring is not None else staged_bytes
        _log_save(result, rank)
        return result

    handle = background_save.AsyncSave(
        storage.uri,
        work,
        blocking_seconds=time.perf_counter() - started,
        started=started,
        staged=stage,
    )
    background_save.register(group, handle)
    if ring is not None and not background_staging:  # returns once the last piece is copied
        handle.until_staged()
        handle.blocking_seconds = time.perf_counter() - started
    return handle


def _check_and_collect(
    state: Mapping[str, Any],
    step,
    metadata,
    metrics,
    group,
    *,
    stage: bool = False,
    cap: int | None = None,
    arena=None,
    vote: PlanReuse | None = None,
    where: str = "",
    overwrite: bool = False,
) -> tuple[tuple[dict[str, Any], dict[str, Any], int | None], dict[str, Any]]:
    """Every check of a save's arguments and the state dict to write (staged to CPU memory
    when `stage`), run inside one collective round (`_dist.agree`), where `vote` says
    whether the state's structure is the one its plan cache holds. Every rank must pass the
    same step and `overwrite` (checked in that round: RanksDisagreeError on every rank
    otherwise; the coordinator alone acts on `overwrite`, so a rank's other value would be
    ignored silently). With a
    staging `cap`, a tensor larger than it is refused here (StagingCapError)."""
    # agreed first: a rank failing here must not skip the collective steps the others then take
    user_metadata, checked_metrics, checked_step = _dist.agree(
        lambda: (check_metadata_json(metadata), check_metrics(metrics), None if step is None else check_step(step)),
        group,
        same=lambda checked: rank_checks.step_and_overwrite(checked[2], overwrite),
        disagree=rank_checks.step_disagreement("save"),
    )
    state_dict = to_save_state_dict(state, rank=_dist.get_rank(group), agree=_dist.agreement(group))
    if rank_checks.replicas_checked() and _dist.is_distributed():
        rank_checks.check_replicas(state_dict, group, where)
    if cap is not None:
        capped_staging.check_fits(capped_staging.tensor_sizes(state_dict), cap, rank=_dist.get_rank(group), where=where)
    if stage:
        state_dict = background_save.stage(state_dict, group, arena)  # the copy the background writes
    return (user_metadata, checked_metrics, checked_step), _voted(vote, state_dict)


def _voted(reuse: PlanReuse | None, state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict`, after `reuse` voted on it (the state DCP will be given, as it is)."""
    if reuse is not None:
        reuse.vote(state_dict)
    return state_dict


def _log_save(result: SaveResult, rank: int) -> None:
    log_operation(
        "save",
        uri=result.uri,
        step=result.step,
        nbytes=result.total_bytes,
        seconds=result.seconds,
        world_size=result.world_size,
        blocked_seconds=result.blocked_seconds,
        rank=rank,
    )


def _saving(storage: Storage, step: int | None) -> str:
    """How errors name a save (a rank lost during it, see `_dist.peer_loss_as_error`)."""
    return f"save of step {step} to {storage.uri}" if step is not None else f"save to {storage.uri}"


def _write(transaction: SaveTransaction, state_dict: dict[str, Any], group, reuse: PlanReuse) -> SaveResult:
    """Every rank writes its shard through DCP and `transaction`, which prepares the target
    before any write and commits after `.metadata`, inside DCP's own collectives; `reuse`
    (its agreement round ran) caches the plans once the save committed."""
    storage, step = transaction.storage, transaction.step
    planner = CkptSavePlanner(reuse=reuse)
    transaction.plan_timing = planner.timing

    def save(writer) -> Any:
        with dcp_shims.quiet_single_process(), gc_paused():
            return dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group)

    with _dist.peer_loss_as_error(_saving(storage, step), group, step=step, path=storage.uri):
        total_bytes = transaction.run(save, group)
    reuse.install()
    return SaveResult(
        uri=storage.uri,
        step=step,
        world_size=transaction.world_size,
        total_bytes=total_bytes,
        planning_seconds=planner.timing.planning_s,
        global_plan_seconds=transaction.global_plan_seconds,
        plan_reused=reuse.hit,
    )


__all__ = ["SaveResult", "async_save", "save"]
