"""`save` and `load`: collective, elastic, committed-or-nothing checkpoints.

Every rank calls them (or a single process without a process group). Errors are raised
on every rank alike, and a failed save never touches a committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import _dist, background_save
from ._torch import dcp_shims
from .background_save import AsyncSave
from .errors import (
    CastWarning,
    CheckpointError,
    DtypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    stacklevel_outside_ckptlib,
)
from .format import CheckpointInfo, CkptSavePlanner, CkptWriter, SafeLoadPlanner, prepare_save_target
from .format.dcp_writer import checkpoint_bytes
from .format.deletion import remove_failed_save
from .format.layout import commit_manifest
from .format.manifest import check_metadata_json, check_metrics
from .format.source import inspect_checkpoint, open_reader
from .gc_pause import gc_paused
from .load_keys import Rename, build_request, select_entries
from .observe import log_operation, mib_per_s
from .state import CollectiveSteps, apply_all, to_load_target, to_save_state_dict
from .steps import check_step
from .storage import Storage, as_storage

T = TypeVar("T")


@dataclasses.dataclass
class SaveResult:
    """What a save committed: its size (every file), the saving world size, how long it took
    (`seconds`, for an async save from the call to the commit) and, for an async save, how
    long the caller was blocked (`blocked_seconds`; None for a synchronous save)."""

    uri: str
    step: int | None
    world_size: int
    total_bytes: int
    seconds: float = 0.0
    blocked_seconds: float | None = None

    @property
    def bytes(self) -> int:
        return self.total_bytes

    @property
    def mib_per_s(self) -> float | None:
        return mib_per_s(self.total_bytes, self.seconds)


@dataclasses.dataclass
class LoadResult:
    """What a load restored: the checkpoint's step, saved world size, user metadata, and the
    keys a non-strict load skipped because the checkpoint lacks them."""

    uri: str
    step: int | None
    world_size: int | None  # the world size that saved it
    metadata: dict[str, Any]
    format: str
    missing_keys: list[str]
    notes: list[str]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    bytes: int | None = None  # the checkpoint's size (its files; tensor bytes for foreign formats)
    seconds: float = 0.0
    load_world_size: int = 1  # the world size that loaded it

    @property
    def mib_per_s(self) -> float | None:
        return mib_per_s(self.bytes, self.seconds)


def _unwrap_dcp_error(exc: BaseException) -> CheckpointError:
    """Turn DCP's CheckpointException (failures gathered from all ranks) into a ckptlib error."""
    failures = dcp_shims.dcp_failures(exc)
    for rank, inner in failures:
        if isinstance(inner, CheckpointError):
            if inner.rank is None:  # raised on that rank (a decision for every rank has its rank set)
                inner.rank = rank
                if not inner.message.startswith("rank "):
                    inner.message = f"rank {rank}: {inner.message}"
                    inner.args = (inner.message,)
            return inner
    parts = [f"rank {rank}: {type(inner).__name__}: {inner}" for rank, inner in failures]
    return CheckpointError("; ".join(parts) or str(exc), rank=failures[0][0] if failures else None)


def save(
    uri: str | os.PathLike | Storage,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    overwrite: bool = False,
    process_group=None,
) -> SaveResult:
    """Save `state` as a sharded DCP checkpoint at `uri` and commit it with a manifest.

    Collective: every rank of `process_group` calls it with its own shard of the state.
    `metrics` (name -> number, rank 0's values) go into the manifest for retention
    (`KeepBest`) and listings; NaN and infinities are stored as null.
    For a save that returns once the state is staged, see `async_save`.
    """
    started = time.perf_counter()
    storage = as_storage(uri)
    group = process_group
    rank, world = _dist.get_rank(group), _dist.get_world_size(group)
    with _dist.peer_loss_as_error(_saving(storage, step), group, step=step, path=storage.uri):
        (user_metadata, user_metrics, step), state_dict = _dist.agree(
            lambda: _check_and_collect(state, step, metadata, metrics, group), group
        )
    result = _write_and_commit(
        storage,
        state_dict,
        group,
        world=world,
        step=step,
        user_metadata=user_metadata,
        user_metrics=user_metrics,
        overwrite=overwrite,
    )
    result.seconds = time.perf_counter() - started
    _log_save(result, rank)
    return result


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
) -> AsyncSave:
    """`save`, returning an `AsyncSave` handle as soon as the state is staged to CPU memory;
    the write and the commit run in a background thread on a dedicated gloo group (see
    `ckptlib.background_save`). `handle.wait()` returns the SaveResult or raises the failure.

    `background_staging=True`: return before the staging copy, which then runs first in the
    background. Nothing may change the state until `handle.wait_staged()` returned: not an
    optimizer step, and not a forward pass in training mode that updates buffers (BatchNorm's
    running statistics). Without such buffers, calling it right before `optimizer.step()`
    lets the device-to-host copy overlap forward and backward on a GPU.
    """
    return start_async_save(
        uri,
        state,
        step=step,
        metadata=metadata,
        metrics=metrics,
        overwrite=overwrite,
        process_group=process_group,
        background_staging=background_staging,
    )


def start_async_save(
    uri: str | os.PathLike | Storage,
    state: Mapping[str, Any],
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    overwrite: bool = False,
    process_group=None,
    background_staging: bool = False,
    wrap: Callable[[Callable[[], SaveResult], Any], SaveResult] | None = None,
) -> AsyncSave:
    """`async_save` for ckptlib's own callers: `wrap(run, group)` runs the background work
    (`run()` writes and commits) and may add to it, e.g. the manager's publish after the
    commit; `group` is the dedicated group its collectives must use."""
    started = time.perf_counter()
    storage = as_storage(uri)
    group = process_group
    background_save.wait_inflight(group)  # one background save per group at a time
    bg_group = background_save.async_group(group)
    rank, world = _dist.get_rank(group), _dist.get_world_size(group)
    with _dist.peer_loss_as_error(_saving(storage, step), group, step=step, path=storage.uri):
        (user_metadata, user_metrics, step), state_dict = _dist.agree(
            lambda: _check_and_collect(state, step, metadata, metrics, group, stage=not background_staging), group
        )

    def write() -> SaveResult:
        return _write_and_commit(
            storage,
            state_dict,
            bg_group,
            world=world,
            step=step,
            user_metadata=user_metadata,
            user_metrics=user_metrics,
            overwrite=overwrite,
        )

    def work() -> SaveResult:
        nonlocal state_dict
        if background_staging:
            # Every rank learns of a copy that failed on one (on the background's group).
            state_dict = _dist.agree(lambda: background_save.stage(state_dict, group), bg_group)
            handle.mark_staged()
        # Preparing the target (removing debris) waits for the disk, so it runs in the
        # background too, still before any shard is written; its errors
        # (CheckpointExistsError) come from wait().
        result = write() if wrap is None else wrap(write, bg_group)
        result.seconds = time.perf_counter() - started
        result.blocked_seconds = handle.blocking_seconds
        _log_save(result, rank)
        return result

    handle = background_save.AsyncSave(
        storage.uri,
        work,
        blocking_seconds=time.perf_counter() - started,
        started=started,
        staged=not background_staging,
    )
    background_save.register(group, handle)
    return handle


def _agreement(group) -> Callable[[Callable[[], Any]], Any] | None:
    """`_dist.agree` on `group`, for CollectiveSteps; None in a single process."""
    return (lambda fn: _dist.agree(fn, group)) if _dist.is_distributed() else None


def _check_and_collect(
    state: Mapping[str, Any], step, metadata, metrics, group, *, stage: bool = False
) -> tuple[tuple[dict[str, Any], dict[str, Any], int | None], dict[str, Any]]:
    """Every check of a save's arguments and the state dict to write (staged to CPU memory
    when `stage`), run inside one collective round (`_dist.agree`)."""
    # agreed first: a rank failing here must not skip the collective steps the others then take
    user_metadata, checked_metrics, checked_step = _dist.agree(
        lambda: (check_metadata_json(metadata), check_metrics(metrics), None if step is None else check_step(step)),
        group,
    )
    state_dict = to_save_state_dict(state, rank=_dist.get_rank(group), agree=_agreement(group))
    if stage:
        state_dict = background_save.stage(state_dict, group)  # the copy the background writes
    return (user_metadata, checked_metrics, checked_step), state_dict


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


def _checkpoint_size(info: CheckpointInfo) -> int | None:
    """A checkpoint's size: its files per the manifest, else the bytes of its tensors."""
    if info.manifest is not None:
        return info.manifest.total_bytes
    total = 0
    for md in info.metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            total += math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()
    return total


def _on_coordinator(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` runs on the coordinator inside a DCP collective, deciding for every rank: a
    CheckpointError reaches every rank as it is (no per-rank prefix); any other exception
    as a CheckpointError "rank N: Type: message"."""

    def run(*args: Any) -> T:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised, portable, on every rank by DCP
            error = _dist.portable_error(exc, _dist.get_rank())
            if error is exc:
                raise
            raise error from exc

    return run


def _saving(storage: Storage, step: int | None) -> str:
    """How errors name a save (a rank lost during it, see `_dist.peer_loss_as_error`)."""
    return f"save of step {step} to {storage.uri}" if step is not None else f"save to {storage.uri}"


def _write_and_commit(
    storage: Storage,
    state_dict: dict[str, Any],
    group,
    *,
    world: int,
    step: int | None,
    user_metadata: dict[str, Any],
    user_metrics: dict[str, Any],
    overwrite: bool,
) -> SaveResult:
    """Every rank writes its shard through DCP; the coordinator prepares the target before
    any write and commits the manifest after `.metadata`, inside DCP's own collectives."""

    def prepare() -> None:
        prepare_save_target(storage, overwrite=overwrite, world_size=world)

    def commit_files(files: dict[str, Any]) -> None:
        commit_manifest(storage, files, world_size=world, step=step, metadata=user_metadata, metrics=user_metrics)

    writer = CkptWriter(storage, prepare=_on_coordinator(prepare), commit=_on_coordinator(commit_files))
    with _dist.peer_loss_as_error(_saving(storage, step), group, step=step, path=storage.uri):
        try:
            with dcp_shims.quiet_single_process(), gc_paused():
                metadata = dcp.save(state_dict, storage_writer=writer, planner=CkptSavePlanner(), process_group=group)
        except BaseException as exc:
            # Every rank removes what this save wrote (a full disk must not stay full; the next
            # save then succeeds by itself); a committed checkpoint is never touched.
            remove_failed_save(
                storage, shard=writer.unfinished_shard, coordinator=writer.is_coordinator, prepared=writer.prepared
            )
            if isinstance(exc, dcp_shims.checkpoint_exception_cls()):
                raise _unwrap_dcp_error(exc) from exc
            raise
    return SaveResult(uri=storage.uri, step=step, world_size=world, total_bytes=checkpoint_bytes(metadata))


def _is_lossless(saved: torch.dtype, requested: torch.dtype) -> bool:
    """Every value of `saved` is exactly representable in `requested` (a widening: fp16->fp32,
    int32->int64, bool->int8); float<->int and narrowing conversions are lossy."""
    if saved.is_complex != requested.is_complex or saved.is_floating_point != requested.is_floating_point:
        return saved == torch.bool and not requested.is_complex
    return torch.promote_types(saved, requested) == requested


def _describe_casts(casts: dict[str, tuple[torch.dtype, torch.dtype]]) -> str:
    shown = [
        f"{key} saved as {str(saved).replace('torch.', '')}, requested {str(requested).replace('torch.', '')}"
        f"{'' if _is_lossless(saved, requested) else ' (lossy)'}"
        for key, (saved, requested) in list(casts.items())[:20]
    ]
    return "; ".join(shown) + (f" ... ({len(casts)} in all)" if len(casts) > 20 else "")


def _check_request(
    template: dict[str, Any],
    info: CheckpointInfo,
    strict: bool,
    keep_if_absent: frozenset[str] = frozenset(),
    cast: bool = False,
) -> tuple[list[str], list[str], dict[str, tuple[torch.dtype, torch.dtype]]]:
    """Compare the requested keys with the checkpoint; return the missing ones, the absent ones
    the state keeps its own value for (`LoadTarget.keep_if_absent`), and the dtype conversions
    the load will make ({key: (saved, requested)}, only with `cast`)."""
    saved = info.metadata.state_dict_metadata
    flat = dcp_shims.flatten_state_dict(template)[0]
    missing = sorted(k for k in flat if k not in saved)
    if missing:  # a checkpoint from torch <= 2.3 keys nested plain values differently
        old_flat = dcp_shims.flatten_state_dict_pre_2_4(template)[0]
        old_missing = sorted(k for k in old_flat if k not in saved)
        if len(old_missing) < len(missing):
            flat, missing = old_flat, old_missing
    # Kept only where the checkpoint holds the same param group (an optimizer it lacks stays missing).
    groups = {k.rsplit(".", 1)[0] for k in saved}
    kept = [k for k in missing if k in keep_if_absent and k.rsplit(".", 1)[0] in groups]
    missing = [k for k in missing if k not in keep_if_absent]
    if missing and strict:
        shown = ", ".join(missing[:20]) + (f" ... ({len(missing)} in all)" if len(missing) > 20 else "")
        raise MissingKeysError(f"{info.uri} lacks keys the state asks for: {shown}", keys=missing, path=info.uri)
    problems = []
    bad_keys = []
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for key, value in flat.items():
        meta = saved.get(key)
        if meta is None:
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                problems.append(f"{key}: a tensor in the state, a non-tensor object in the checkpoint")
            elif tuple(value.shape) != tuple(meta.size):
                problems.append(f"{key}: shape {tuple(value.shape)} in the state, {tuple(meta.size)} in the checkpoint")
            else:
                if value.dtype != meta.properties.dtype:
                    casts[key] = (meta.properties.dtype, value.dtype)
                continue
            bad_keys.append(key)
        elif isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key}: a {type(value).__name__} in the state, a tensor in the checkpoint")
            bad_keys.append(key)
    if problems:
        problems += [
            f"{key}: dtype {requested} in the state, {saved} in the checkpoint"
            for key, (saved, requested) in casts.items()
        ]
        raise ShapeMismatchError(
            f"{info.uri}: state does not match the checkpoint: " + "; ".join(problems[:20]),
            keys=bad_keys + list(casts),
            path=info.uri,
        )
    if casts and not cast:
        raise DtypeMismatchError(
            f"{info.uri}: dtypes differ from the checkpoint ({_describe_casts(casts)}); pass cast=True to convert them",
            keys=list(casts),
            casts=casts,
            path=info.uri,
        )
    return missing, kept, casts


def load(
    uri: str | os.PathLike | Storage,
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    cast: bool = False,
    verify: bool = True,
    trusted: bool = False,
    process_group=None,
    only: Sequence[str] | None = None,
    ignore_keys: Sequence[str] | None = None,
    rename: Rename | None = None,
) -> LoadResult:
    """Load a checkpoint into `state` in place, at any world size; return what was loaded.

    `strict`: keys the state asks for but the checkpoint lacks are errors; with strict=False
    they are skipped and listed in `LoadResult.missing_keys`. Keys in the checkpoint that the
    state does not ask for are never an error. Shape differences are always errors.
    `cast`: a tensor whose dtype differs from the checkpoint's is a DtypeMismatchError
    (strict or not) unless cast=True, which converts it and warns (CastWarning) with the keys.
    `verify`: check every byte read against the manifest's checksums (see README, Integrity).

    Load control (see `ckptlib.load_keys`): `only=("model",)` loads just those top-level
    entries of `state` (a model-only load of a full checkpoint); `ignore_keys` (globs on the
    state's flattened keys) are neither loaded nor missing; `rename` maps checkpoint keys
    to state keys (`{old_prefix: new_prefix}` or a callable).
    """
    started = time.perf_counter()
    storage = as_storage(uri)
    with _dist.peer_loss_as_error(f"load of {storage.uri}", process_group, path=storage.uri), gc_paused():
        return _load(
            storage,
            state,
            strict=strict,
            cast=cast,
            verify=verify,
            trusted=trusted,
            group=process_group,
            only=only,
            ignore_keys=ignore_keys,
            rename=rename,
            started=started,
        )


def _load(
    storage: Storage,
    state: Mapping[str, Any],
    *,
    strict: bool,
    cast: bool,
    verify: bool,
    trusted: bool,
    group,
    only: Sequence[str] | None,
    ignore_keys: Sequence[str] | None,
    rename: Rename | None,
    started: float,
) -> LoadResult:
    rank, world = _dist.get_rank(group), _dist.get_world_size(group)
    info = _dist.decide_on_rank0(lambda: inspect_checkpoint(storage, verify=verify, trusted=trusted), group)
    selected = _dist.agree(lambda: select_entries(state, only, ignore_keys), group)

    plan = _dist.agree(
        lambda: to_load_target(
            selected,
            rank=rank,
            world_size=world,
            saved_world_size=info.world_size,
            step=info.step,
            strict=strict,
            agree=_agreement(group),
        ),
        group,
    )
    keyed = None
    if ignore_keys is not None or rename is not None:
        saved_keys = list(info.metadata.state_dict_metadata)
        keyed = _dist.agree(
            lambda: build_request(plan.template, saved_keys, ignore_keys=ignore_keys, rename=rename), group
        )

    def check() -> tuple[list[str], list[str], dict]:
        unsourced = keyed.unsourced if keyed is not None else []
        if unsourced and strict:
            raise MissingKeysError(
                f"{info.uri}: no checkpoint key is renamed to {', '.join(unsourced[:20])} (rename= renamed their "
                "own names away)",
                keys=unsourced,
                path=info.uri,
            )
        request = plan.template if keyed is None else keyed.request
        missing, kept, casts = _check_request(request, info, strict, plan.keep_if_absent, cast)
        return sorted(missing + unsourced), kept, casts

    missing, kept, casts = _dist.agree(check, group)
    if casts:
        warnings.warn(
            f"{storage.uri}: converted to the dtypes the state asked for: {_describe_casts(casts)}",
            CastWarning,
            stacklevel=stacklevel_outside_ckptlib(),
        )
    notes = list(plan.notes)
    if kept:
        notes.append(
            f"the checkpoint lacks optimizer hyperparameters {', '.join(kept)} (the torch that saved it did not "
            "have them); the optimizers keep their own values"
        )

    reader, _ = open_reader(storage, info=info, verify=verify, trusted=trusted)
    # Every other key was checked above, so a partial load skips only the kept ones.
    planner = SafeLoadPlanner(trusted=trusted, allow_partial_load=not strict or bool(kept))
    try:
        with dcp_shims.quiet_single_process():
            dcp.load(
                plan.template if keyed is None else keyed.request,
                storage_reader=reader,
                planner=planner,
                process_group=group,
            )
    except dcp_shims.checkpoint_exception_cls() as exc:
        raise _unwrap_dcp_error(exc) from exc

    def give_back() -> None:
        if selected is not state:  # plain values replaced in the selection go back to the caller's mapping
            for name, value in selected.items():
                if state[name] is not value:
                    state[name] = value  # type: ignore[index]

    # ends in an agreement (give_back is a local step): raises on every rank or on none
    steps = CollectiveSteps(_agreement(group))
    if keyed is not None:
        steps.local(keyed.copy_back)
    apply_all(plan, steps)
    steps.local(give_back)
    steps.finish()
    result = LoadResult(
        uri=storage.uri,
        step=info.step,
        world_size=info.world_size,
        metadata=dict(info.manifest.metadata) if info.manifest else {},
        format=info.kind,
        missing_keys=missing,
        notes=notes + list(getattr(info, "notes", []) or []),
        metrics=dict(info.manifest.metrics) if info.manifest else {},
        bytes=_checkpoint_size(info),
        seconds=time.perf_counter() - started,
        load_world_size=world,
    )
    log_operation(
        "load",
        uri=result.uri,
        step=result.step,
        nbytes=result.bytes,
        seconds=result.seconds,
        world_size=world,
        saved_world_size=result.world_size,
        rank=rank,
    )
    return result
