"""`load`: fill a state from any checkpoint ckptlib reads, at any world size.

Collective, in three steps: rank 0 inspects the checkpoint and broadcasts what it found;
every rank then computes its own checks (the entries to load, the state dicts to load into,
the keys, shapes and dtypes against the checkpoint's) and the ranks agree once on the
outcome, so a failure on any rank is raised on every rank, never a hang; then DCP loads and
the state's `load_state_dict`s apply the values (agreeing again before any step that may run
collectives of its own; the last agreement also gathers every rank's bytes read).

Reads (`ckptlib.format.read.read_schedule`): an item several ranks need (replicated state) is read
from storage by one rank and sent to the others over the process group (`read_exchange`);
`copies=`/`info=` let a load read each file from the nearest intact copy (the contract, for
the cluster tier, is `ckptlib.format.read.copies`'s docstring).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any, Mapping, Sequence

import torch.distributed.checkpoint as dcp

from ckptlib import presets
from ckptlib._runtime import agree as _dist
from ckptlib._runtime import progress as progress_bars
from ckptlib._runtime.gc_pause import gc_paused
from ckptlib._runtime.observe import log_operation, mib_per_s
from ckptlib._torch import dcp_shims
from ckptlib.errors import CastWarning, MissingKeysError, UnusedKeysError, stacklevel_outside_ckptlib
from ckptlib.format.native.layout import CheckpointInfo
from ckptlib.format.read.copies import Copies, as_copies, default_label, info_from_bytes, open_from_copies
from ckptlib.format.read.dcp_reader import CkptReader
from ckptlib.format.read.load_planner import SafeLoadPlanner
from ckptlib.format.source import inspect_checkpoint, open_reader
from ckptlib.loading import read_cost, read_exchange
from ckptlib.loading.load_checks import (
    UnusedKeys,
    check_request,
    checkpoint_size,
    describe_casts,
    describe_unused,
    unused_candidates,
)
from ckptlib.loading.load_keys import KeyRequest, Rename, build_request, ignore_patterns, select_entries
from ckptlib.state.state import CollectiveSteps, LoadTarget, RankLocal, apply_all, to_load_target
from ckptlib.state.state_checks import check_call
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage


@dataclasses.dataclass(frozen=True, order=True)
class UnusableCopy:
    """A copy of one checkpoint file that a load could not use (`ckptlib.format.read.copies`):
    its `key` (which copy, across ranks), the `file`'s name, its `label` ("local", "replica",
    "remote"), its `uri` and what was wrong with it."""

    key: str
    file: str
    label: str
    uri: str
    problem: str


@dataclasses.dataclass
class LoadResult:
    """What a load restored: the checkpoint's step, saved world size, user metadata, and the
    keys a non-strict load skipped because the checkpoint lacks them; and what it read: the
    shard-file bytes this rank and each rank read from storage, those bytes by copy label
    ("local", "replica", "remote"; summed over ranks), the bytes this rank received from other
    ranks instead, and the bytes the load needed (every stored item any rank's plan reads,
    once). Read once: sum(storage_bytes_read_by_rank) is about bytes_needed, not N times it."""

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
    storage_bytes_read: int = 0  # shard-file bytes this rank read from storage
    storage_bytes_read_by_rank: list[int] = dataclasses.field(default_factory=list)
    bytes_by_source: dict[str, int] = dataclasses.field(default_factory=dict)  # per copy label, all ranks
    bytes_received: int = 0  # item bytes this rank received from other ranks
    bytes_needed: int | None = None  # the distinct stored items the load read (None: foreign formats)
    # every copy of a file some rank found missing, short or damaged and read past (the same on
    # every rank): what the cluster tier sets aside so that no later upload or load trusts it
    unusable_copies: list[UnusableCopy] = dataclasses.field(default_factory=list)
    read_once: bool = False  # whether items several ranks needed were read once and exchanged
    unused_keys: list[str] = dataclasses.field(default_factory=list)  # checkpoint keys no rank asked for

    @property
    def mib_per_s(self) -> float | None:
        return mib_per_s(self.bytes, self.seconds)


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
    preset: str | presets.Preset | None = None,
    copies: Copies | Sequence | Mapping | None = None,
    info: CheckpointInfo | tuple[bytes | None, bytes] | None = None,
    read_once: bool | str = "auto",
    allow_unused: bool = True,
    progress: Any = None,
) -> LoadResult:
    """Load a checkpoint into `state` in place, at any world size; return what was loaded.

    `strict`: keys the state asks for but the checkpoint lacks are errors; with strict=False
    they are skipped and listed in `LoadResult.missing_keys`. Keys in the checkpoint that the
    state does not ask for are listed in `LoadResult.unused_keys` (and a note);
    `allow_unused=False` makes them an UnusedKeysError before anything is read (keys left out
    on purpose by `only=`/`ignore_keys`, and other ranks' per-rank state, are not unused).
    Shape differences are always errors.
    `cast`: a tensor whose dtype differs from the checkpoint's is a DtypeMismatchError
    (strict or not) unless cast=True, which converts it and warns (CastWarning) with the keys.
    `verify`: check every byte read against the manifest's checksums (see docs/integrity.md).

    Load control (see `ckptlib.loading.load_keys`): `only=("model",)` loads just those top-level
    entries of `state` (a model-only load of a full checkpoint); `ignore_keys` (globs on the
    state's flattened keys) are neither loaded nor missing; `rename` maps checkpoint keys
    to state keys (`{old_prefix: new_prefix}` or a callable).

    `preset` ("composer", "torchtitan", "lightning": `ckptlib.presets`) reads another tool's
    checkpoint as it lays it out: `uri` may be its save folder (the newest checkpoint is
    read), its keys load into the state's own entries (`rename` then applies on top), the
    plain-data objects it saves need no `trusted=True`, and its progress (Composer's
    timestamp, Lightning's meta.pt, torchtitan's train_state) is `LoadResult.step` and
    `LoadResult.metadata`.

    Reads: `copies` (this rank's copies of the checkpoint, each file read from the first that
    holds it intact) and `info` (its manifest and `.metadata`, already read): the cluster
    tier's entry point, see `ckptlib.format.read.copies`. `read_once=True`: an item several ranks
    need is read by one of them and sent to the others; `False`: every rank reads what it needs
    itself, as plain DCP does; `"auto"` (the default): read once from object stores, network
    filesystems and copies, directly from a local disk (`ckptlib.loading.read_cost`). What the
    load did is `LoadResult.read_once`. `progress`: a bar on stderr (None: when it is a
    terminal; True, False) or `fn(op, done, total)`, on rank 0 (`ckptlib._runtime.progress`).
    """
    started = time.perf_counter()
    read_cost.check(read_once)
    progress_bars.check(progress)
    check_call("load", uri, state)
    storage = as_storage(uri)
    with _dist.called_by_every_rank("load", f"load of {storage.uri}", process_group, path=storage.uri):
        if preset is not None:
            return _load_with_preset(
                presets.get(preset),
                storage,
                state,
                strict=strict,
                cast=cast,
                verify=verify,
                trusted=trusted,
                process_group=process_group,
                only=only,
                ignore_keys=ignore_keys,
                rename=rename,
                copies=copies,
                info=info,
                read_once=read_once,
                allow_unused=allow_unused,
                progress=progress,
            )
        rank = _dist.get_rank(process_group)
        with (
            _dist.peer_loss_as_error(f"load of {storage.uri}", process_group, path=storage.uri),
            gc_paused(),
            progress_bars.reporting("load", storage.uri, progress, rank),
        ):
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
                copies=copies,
                given_info=info,
                read_once=read_once,
                allow_unused=allow_unused,
                started=started,
            )


def _load_with_preset(
    preset: presets.Preset, storage: Storage, state: Mapping[str, Any], *, process_group, trusted: bool, **kwargs
) -> LoadResult:
    """`load` of a client's checkpoint through its preset (see `load`)."""
    name = _dist.decide_on_rank0(lambda: preset.checkpoint_name(storage), process_group)
    if name is not None:
        storage = storage.child(name)
    adapted = preset.adapt_state(state)
    rename = presets.preset.then(preset.rename(presets.Entries.of(state)), kwargs.pop("rename"))
    with preset.allowing():
        result = load(storage, adapted, rename=rename, trusted=trusted, process_group=process_group, **kwargs)
        step, progress = _dist.decide_on_rank0(lambda: preset.progress(storage, trusted=trusted), process_group)
    presets.preset.write_back(state, adapted)
    result.metadata = {**result.metadata, **progress}
    if step is not None:
        result.step = step
    return result


@dataclasses.dataclass
class _Request:
    """One rank's load, checked: the state entries it fills, the template DCP loads into (and
    how to hand the values back), and what the checks found."""

    selected: Mapping[str, Any]
    target: LoadTarget
    keyed: KeyRequest | None  # with ignore_keys or rename: the flat request in checkpoint keys
    missing: list[str]
    kept: list[str]  # absent optimizer hyperparameters the state keeps (LoadTarget.keep_if_absent)
    casts: dict
    aliased: dict[str, str] = dataclasses.field(default_factory=dict)  # absent keys their tied alias fills
    unused: set[str] = dataclasses.field(default_factory=set)  # checkpoint keys this rank leaves unread

    @property
    def template(self) -> dict[str, Any]:
        return self.target.template if self.keyed is None else self.keyed.request


def _carrying(held: list[BaseException], group):
    """`_dist.agreement(group)` whose next round also raises `held` (a failure before the state's
    collective steps), so a rank that failed there never leaves the others in them alone."""
    agree = _dist.agreement(group)
    if agree is None:
        return None

    def carried(fn):
        def run():
            if held:
                raise held.pop()
            return fn()

        return agree(run)

    return carried


def _prepare_request(
    state: Mapping[str, Any],
    info: CheckpointInfo,
    *,
    rank: int,
    world: int,
    strict: bool,
    cast: bool,
    only: Sequence[str] | None,
    ignore_keys: Sequence[str] | None,
    rename: Rename | None,
    group,
) -> _Request:
    """Every check of a load on this rank, computed locally; the caller agrees on the outcome
    in one round. Building the state dicts (`to_load_target`) agrees as its collective steps
    require; its first agreement also carries a failure of `select_entries` before it (every
    rank then raises there, in the same round)."""
    held: list[BaseException] = []
    try:
        selected = select_entries(state, only, ignore_keys)
    except Exception as exc:  # noqa: BLE001 - raised by the next agreement, on every rank
        if not _dist.is_distributed():
            raise
        held.append(exc)
        selected = {}
    target = to_load_target(
        selected,
        rank=rank,
        world_size=world,
        saved_world_size=info.world_size,
        step=info.step,
        strict=strict,
        agree=_carrying(held, group),
    )
    keyed = None
    if ignore_keys is not None or rename is not None:
        saved_keys = list(info.metadata.state_dict_metadata)
        keyed = build_request(target.template, saved_keys, ignore_keys=ignore_keys, rename=rename)
    unsourced = keyed.unsourced if keyed is not None else []
    if unsourced and strict:
        raise MissingKeysError(
            f"{info.uri}: no checkpoint key is renamed to {', '.join(unsourced[:20])} (rename= renamed their "
            "own names away)",
            keys=unsourced,
            path=info.uri,
        )
    request = target.template if keyed is None else keyed.request
    missing, kept, casts, aliased, used = check_request(request, info, strict, target.keep_if_absent, cast)
    left_out = [name for name in state if name not in selected or isinstance(state[name], RankLocal)]
    unused = unused_candidates(info.metadata.state_dict_metadata, used, left_out, only, ignore_patterns(ignore_keys))
    return _Request(selected, target, keyed, sorted(missing + unsourced), kept, casts, aliased, unused)


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
    copies,
    given_info,
    read_once: bool | str,
    allow_unused: bool,
    started: float,
) -> LoadResult:
    rank, world = _dist.get_rank(group), _dist.get_world_size(group)

    def own_copies() -> Copies | None:  # checked on rank 0 in the inspection, on the others in the checks' round
        return None if copies is None else as_copies(copies, storage)

    def inspect() -> CheckpointInfo:
        copy_set = own_copies()
        if isinstance(given_info, tuple):
            return info_from_bytes(storage.uri, *given_info, verify=verify)
        if given_info is not None:
            return given_info
        if copy_set is not None:
            return open_from_copies(copy_set, verify=verify)
        return inspect_checkpoint(storage, verify=verify, trusted=trusted)

    info = _dist.decide_on_rank0(inspect, group)
    unused_keys = UnusedKeys(sorted(info.metadata.state_dict_metadata))

    def prepared() -> tuple[_Request, Copies | None]:
        checked = _prepare_request(
            state,
            info,
            rank=rank,
            world=world,
            strict=strict,
            cast=cast,
            only=only,
            ignore_keys=ignore_keys,
            rename=rename,
            group=group,
        )
        unused_keys.mark(checked.unused)
        return checked, own_copies()

    request, copy_set = _dist.agree(prepared, group, unused_keys)  # the unused keys ride in its one round
    unused = unused_keys.found
    if unused and not allow_unused:
        raise UnusedKeysError(
            f"{storage.uri}: {describe_unused(unused)}; load them into the state, leave them out with only= or "
            "ignore_keys=, or pass allow_unused=True",
            keys=unused,
            path=storage.uri,
        )
    if request.casts:
        warnings.warn(
            f"{storage.uri}: converted to the dtypes the state asked for: {describe_casts(request.casts)}",
            CastWarning,
            stacklevel=stacklevel_outside_ckptlib(),
        )
    notes = list(request.target.notes)
    if unused:
        notes.append(f"unused: {describe_unused(unused)}")
    if request.kept:
        notes.append(
            f"the checkpoint lacks optimizer hyperparameters {', '.join(request.kept)} (the torch that saved it did "
            "not have them); the optimizers keep their own values"
        )

    if request.aliased:
        shown = ", ".join(f"{key} from {source}" for key, source in sorted(request.aliased.items())[:20])
        notes.append(f"tied tensors the checkpoint holds under another name were loaded through it: {shown}")

    reader, _ = open_reader(storage, info=info, verify=verify, trusted=trusted, copies=copy_set)
    if isinstance(reader, CkptReader):
        once = read_cost.wanted(read_once, storage, copy_set)
        read_exchange.prepare(reader, group, read_once=once)  # collective on a group's first load
    while True:  # again only when copies failed and others remain (read_exchange.exclude_failed)
        # Every other key was checked above, so a partial load skips only the kept and the aliased ones.
        planner = SafeLoadPlanner(
            trusted=trusted, allow_partial_load=not strict or bool(request.kept or request.aliased)
        )
        try:
            with dcp_shims.quiet_single_process():
                dcp.load(request.template, storage_reader=reader, planner=planner, process_group=group)
            break
        except dcp_shims.checkpoint_exception_cls() as exc:
            if not (isinstance(reader, CkptReader) and read_exchange.exclude_failed(reader, exc, world)):
                raise read_exchange.load_failure(exc) from exc

    selected = request.selected

    def give_back() -> None:
        if selected is not state:  # plain values replaced in the selection go back to the caller's mapping
            for name, value in selected.items():
                if state[name] is not value:
                    state[name] = value  # type: ignore[index]

    role = getattr(reader, "role", None)
    labels = role.labels if role is not None else ()
    own = getattr(reader, "bytes_by_source", {})
    unusable = getattr(reader, "unusable", {})
    mine = [
        reader.bytes_read,
        getattr(reader, "bytes_received", 0),
        len(unusable),
        *(own.get(label, 0) for label in labels),
    ]
    shared = [mine]

    def agree_and_share(fn):
        result, rows = _dist.agree_sharing(fn, mine, group)
        shared[:] = rows
        return result

    # ends in an agreement (give_back is a local step): raises on every rank or on none; its
    # collective also gathers every rank's bytes read
    steps = CollectiveSteps(agree_and_share if _dist.is_distributed() else None)
    if request.keyed is not None:
        steps.local(request.keyed.copy_back)
    apply_all(request.target, steps)
    steps.local(give_back)
    steps.finish()
    if any(row[2] for row in shared):  # rare: one more round, only when some copy failed somewhere
        found = {}
        for rows in _dist.all_gather_object(sorted(unusable.items()), group):
            found.update((pair, entry) for pair, entry in rows)
        unusable = found
    result = LoadResult(
        uri=storage.uri,
        step=info.step,
        world_size=info.world_size,
        metadata=dict(info.manifest.metadata) if info.manifest else {},
        format=info.kind,
        missing_keys=request.missing,
        notes=notes + list(getattr(info, "notes", []) or []),
        metrics=dict(info.manifest.metrics) if info.manifest else {},
        bytes=checkpoint_size(info),
        seconds=time.perf_counter() - started,
        load_world_size=world,
        storage_bytes_read=reader.bytes_read,
        storage_bytes_read_by_rank=[row[0] for row in shared],
        bytes_by_source=_by_source(shared, labels, storage),
        bytes_received=mine[1],
        bytes_needed=role.bytes_needed if role is not None else None,
        read_once=role.read_once if role is not None else False,
        unused_keys=unused,
        unusable_copies=sorted(UnusableCopy(key, name, *entry) for (key, name), entry in unusable.items()),
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
        bytes_read=sum(result.storage_bytes_read_by_rank),
        bytes_by_source=dict(result.bytes_by_source),
    )
    return result


def _by_source(rows: list[list[int]], labels: Sequence[str], storage) -> dict[str, int]:
    """Bytes read per copy label, summed over ranks (a foreign format's: its one source's)."""
    if not labels:
        total = sum(row[0] for row in rows)
        return {default_label(storage): total} if total else {}
    sums = {label: sum(row[3 + i] for row in rows) for i, label in enumerate(labels)}
    return {label: n for label, n in sums.items() if n}


__all__ = ["LoadResult", "UnusableCopy", "load"]
