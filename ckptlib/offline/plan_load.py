"""`plan_load`: a dry run of a resharded load from the checkpoint's metadata alone (`ckpt plan`).

For a load at world size M and a layout, per rank: the stored items its load needs and those
it reads from storage, the bytes it reads (what the load's `LoadResult.storage_bytes_read_by_rank`
will say), the bytes it receives from and sends to other ranks (items several ranks need are
read once, `format.read_schedule`), the files and byte ranges it touches, the read calls and,
on an object store, the GET requests; the bytes of its part of the state and the peak host
memory the load needs (that part plus the largest buffer the reads hold at once). For the
whole load: the bytes read against the bytes the load needs and the checkpoint's size, and
what every rank reading for itself would read (the duplication read-once avoids).

Nothing but the manifest and `.metadata` is read (of a foreign source: what inspecting it
reads, and the first bytes of its torch.save files, to know whether they are memory-mapped);
no process group is made. How ranks ask for keys: `plan_layouts`; how readers turn that into
reads: `plan_reads`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Sequence

from ckptlib.format.foreign.foreign import SourceInfo
from ckptlib.format.foreign.torch_save import memory_mapped
from ckptlib.format.items.item_decoder import DeclaredChunks
from ckptlib.format.items.ranged_io import _coalesce_ranges
from ckptlib.format.source import inspect_checkpoint
from ckptlib.loading import read_cost
from ckptlib.offline.plan_layouts import LAYOUTS, PlanError, rank_plans
from ckptlib.offline.plan_reads import RankReads, Target, ckpt_reads, foreign_bytes, foreign_reads, requests
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage, SupportsDirectReads


@dataclasses.dataclass
class RankPlan:
    rank: int
    items: int  # stored items it reads from storage (for itself, and for others when read once)
    items_needed: int  # stored items its load needs
    bytes_read: int  # bytes it reads from storage (LoadResult.storage_bytes_read)
    bytes_received: int
    bytes_sent: int
    reads: int  # read calls (local preads, or ranged reads of an object store)
    requests: int | None  # GET requests on an object store; None for local files
    files: list[dict[str, Any]]  # {"file", "bytes", "ranges": [[start, end], ...], "reads", "requests"}
    state_bytes: int  # its part of the state: what the load fills
    transient_bytes: int  # the largest buffer the load holds at once beyond the state
    exact: bool = True

    @property
    def peak_host_bytes(self) -> int:
        return self.state_bytes + self.transient_bytes


@dataclasses.dataclass
class LoadPlanReport:
    uri: str
    format: str
    step: int | None
    saved_world_size: int | None
    world_size: int
    layout: str
    storage: str  # "local" or the object store's scheme
    read_once: bool
    checkpoint_bytes: int  # every stored item, once (the checkpoint's data)
    bytes_needed: int  # the stored items some rank's load needs, once each
    ranks: list[RankPlan]
    bytes_read_each_for_itself: int  # what the ranks would read without read-once

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        need = max(self.bytes_needed, 1)
        return {
            "uri": self.uri,
            "format": self.format,
            "step": self.step,
            "saved_world_size": self.saved_world_size,
            "world_size": self.world_size,
            "layout": self.layout,
            "storage": self.storage,
            "read_once": self.read_once,
            "exact": self.exact,
            "checkpoint_bytes": self.checkpoint_bytes,
            "bytes_needed": self.bytes_needed,
            "bytes_read": self.bytes_read,
            "read_amplification": self.bytes_read / need,
            "bytes_read_each_for_itself": self.bytes_read_each_for_itself,
            "amplification_each_for_itself": self.bytes_read_each_for_itself / need,
            "peak_host_bytes": max((r.peak_host_bytes for r in self.ranks), default=0),
            "ranks": [dict(dataclasses.asdict(r), peak_host_bytes=r.peak_host_bytes) for r in self.ranks],
        }


def _rank_plan(reads: RankReads, state_bytes: int, object_store: Storage | None) -> RankPlan:
    by_file: dict[str, list] = {}
    for r in reads.reads:
        by_file.setdefault(r.file, []).append(r)
    chunk = getattr(object_store, "read_chunk_size", None)
    concurrency = getattr(object_store, "max_concurrency", 1)
    files = []
    for name in sorted(by_file):
        rs = by_file[name]
        known = [(r.offset, r.offset + r.length) for r in rs if r.offset >= 0]
        files.append(
            {
                "file": name,
                "bytes": sum(r.length for r in rs if r.kind != "locate"),
                "ranges": [list(x) for x in _coalesce_ranges(known)],
                "reads": len(rs),
                "requests": None if chunk is None else requests(rs, chunk, concurrency),
            }
        )
    return RankPlan(
        rank=reads.rank,
        items=reads.items_read,
        items_needed=reads.items_needed,
        bytes_read=reads.storage_bytes,
        bytes_received=reads.bytes_received,
        bytes_sent=reads.bytes_sent,
        reads=len(reads.reads),
        requests=None if chunk is None else sum(f["requests"] for f in files),
        files=files,
        state_bytes=state_bytes,
        transient_bytes=reads.transient_bytes,
        exact=reads.exact,
    )


def _mapped(storage: Storage, info: SourceInfo, reads: RankReads) -> bool:
    """Whether the files of a rank's piece reads are memory-mapped, so that only the bytes
    copied are read (else the reader reads each torch.save or v0 file whole)."""
    root = as_storage(info.file_root) if info.file_root is not None else storage
    files = {r.file for r in reads.reads if r.offset < 0}
    return all(memory_mapped(root, name) for name in files)


def _target(storage: Storage, info, verify: bool) -> Target:
    manifest = info.manifest
    local = isinstance(storage, SupportsDirectReads) and hasattr(os, "preadv")
    if local:
        name = next(iter(manifest.files), None) if manifest is not None else None
        local = name is None or storage.direct_read_path(name) is not None
    files = manifest.files if manifest is not None else {}
    return Target(
        local=local,
        verify=verify and manifest is not None,
        block_sizes={name: rec.block_size for name, rec in files.items()},
        file_sizes={name: rec.size for name, rec in files.items()},
        has_manifest=manifest is not None,
    )


def plan_load(
    uri: str | os.PathLike | Storage,
    world_size: int,
    layout: str = "fsdp2",
    *,
    params: set[str] | None = None,
    tp_dims: Mapping[str, int | None] | None = None,
    rank_state: str = "keep",
    only: Sequence[str] | None = None,
    read_once: bool | str = "auto",
    verify: bool = True,
    trusted: bool = False,
    on_rank: Callable[[], None] | None = None,
) -> LoadPlanReport:
    """The reads of `ckptlib.load(uri, state)` on `world_size` ranks holding `state` as `layout`
    (see the module). `params` (the model's parameter FQNs) and `tp_dims` ({parameter: the dim
    its TP style shards}, needed by "tp" and "fsdp2+tp") come from the model when known (`ckpt
    plan --spec`); `rank_state="merge"` when per-rank state merges on a resize; `only`, `verify`
    and `read_once` as `load` takes them; `on_rank()` after each rank is planned (progress).
    Raises PlanError for a load that cannot be planned."""
    if not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world size must be a positive integer, got {world_size!r}")
    if layout not in LAYOUTS:
        raise PlanError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    read_cost.check(read_once)
    storage = as_storage(uri)
    info = inspect_checkpoint(storage, verify=verify, trusted=trusted)
    metadata = info.metadata
    plans, state_bytes = rank_plans(
        metadata,
        world_size,
        layout,
        saved_world=info.world_size,
        params=params,
        tp_plan_dims=tp_dims,
        rank_state=rank_state,
        only=only,
    )
    object_store = None if getattr(storage, "read_chunk_size", None) is None else storage
    scheme = storage.uri.split("://", 1)[0] if "://" in storage.uri and object_store is not None else "local"
    if isinstance(info, SourceInfo):
        reads = foreign_reads(plans, metadata.storage_data, info, on_rank)
        needed, stored = foreign_bytes(plans, metadata)
        ranks = [_rank_plan(r, b, object_store) for r, b in zip(reads, state_bytes)]
        if not all(_mapped(storage, info, r) for r in reads):
            for r in ranks:
                r.exact = False
        alone = sum(r.bytes_read for r in ranks)
        return LoadPlanReport(
            storage.uri, info.kind, info.step, info.world_size, world_size, layout, scheme, False,
            stored, needed, ranks, alone,
        )  # fmt: skip
    target = _target(storage, info, verify)
    declared = DeclaredChunks(metadata)
    once = read_cost.wanted(read_once, storage, None) and world_size > 1
    reads, schedule = ckpt_reads(plans, metadata.storage_data, declared, target, read_once=once, on_rank=on_rank)
    alone_reads, _ = ckpt_reads(plans, metadata.storage_data, declared, target, read_once=False)
    records = {(rec.relative_path, rec.offset, rec.length) for rec in metadata.storage_data.values()}
    ranks = [_rank_plan(r, b, object_store) for r, b in zip(reads, state_bytes)]
    return LoadPlanReport(
        uri=storage.uri,
        format=info.kind,
        step=info.step,
        saved_world_size=info.world_size,
        world_size=world_size,
        layout=layout,
        storage=scheme,
        read_once=once,
        checkpoint_bytes=sum(length for _, _, length in records),
        bytes_needed=schedule.bytes_needed,
        ranks=ranks,
        bytes_read_each_for_itself=sum(r.storage_bytes for r in alone_reads),
    )


__all__ = ["LAYOUTS", "LoadPlanReport", "PlanError", "RankPlan", "plan_load"]
