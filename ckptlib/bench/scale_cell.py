"""One cell of `ckpt bench scale`: the coordinator's side of a save, twice, and rank 0's open
for a load, at a simulated world size, through ckptlib's own code.

The ranks are simulated by what reaches the coordinator from them: each rank's local save
plan and its write results, pickled as DCP's gathers carry them (row-sharded tensors, one
chunk per rank per tensor; half "wide", more columns than rows like an MLP down-projection,
half "tall"). The coordinator then runs what `ckptlib.save` runs: `CkptSavePlanner`'s global
plan, `CkptWriter.prepare_global_plan` and the scatter's pickles, the gathered results decoded,
`CkptWriter.finish` (`.metadata` and the manifest, through a real `SaveTransaction` on an
in-memory storage). The second save reuses the first one's plans (`format.plan_cache`: every
rank sends an empty plan) as a save of an unchanged state does. Rank 0's open is
`open_checkpoint` on the files written, plus pickling what `decide_on_rank0` broadcasts. One
rank's load: unpickling `.metadata` (what every rank does with the broadcast), then its reads
of every tensor through ckptlib's `chunk_index` and, for comparison, DCP's own function.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import time
import tracemalloc
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from ckptlib._runtime.gc_pause import gc_paused
from ckptlib._torch import dcp_shims
from ckptlib.format.native import plan_codec
from ckptlib.format.native.layout import open_checkpoint
from ckptlib.format.native.manifest import FileRecord
from ckptlib.format.read import chunk_index
from ckptlib.format.write.dcp_writer import CkptWriter
from ckptlib.format.write.plan_cache import CachedPlan, PlanCache, PlanReuse
from ckptlib.format.write.save_planner import CkptSavePlanner
from ckptlib.format.write.transaction import SaveTransaction

ROWS_PER_RANK, TALL_COLS = 4, 64  # tall tensors: (world * 4, 64); wide ones: (world * 4, world * 16)
BLOCK = 1 << 20


def tensor_names(count: int) -> list[str]:
    return [f"model.layers.{i // 16}.param{i % 16}.weight" for i in range(count)]


def cols(world: int, index: int) -> int:
    return world * ROWS_PER_RANK * 4 if index % 2 else TALL_COLS


def chunk(rank: int, width: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([rank * ROWS_PER_RANK, 0]), sizes=torch.Size([ROWS_PER_RANK, width]))


def _item_bytes(width: int) -> int:
    return 800 + ROWS_PER_RANK * width * 4  # a torch.save archive of the chunk, roughly


def rank_plan(world: int, names: list[str], rank: int) -> bytes:
    """Rank `rank`'s local save plan as the coordinator receives it (pickled, compact)."""
    props = TensorProperties(dtype=torch.float32)
    items = []
    for i, name in enumerate(names):
        part = chunk(rank, cols(world, i))
        size = torch.Size([world * ROWS_PER_RANK, cols(world, i)])
        items.append(
            WriteItem(
                index=MetadataIndex(name, part.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=part, properties=props, size=size),
            )
        )
    plan = SavePlan(items, planner_data={name: (name,) for name in names})
    return pickle.dumps(plan_codec.compact_save_plan(plan))


def rank_results(world: int, names: list[str], rank: int) -> bytes:
    """Rank `rank`'s write results (and its shard's record) as the coordinator receives them."""
    info = dcp_shims.storage_info_cls()
    shard = f"__{rank}_0.distcp"
    results = plan_codec.WriteResults()
    results.info_cls = info
    records, offset = [], 0
    for i, name in enumerate(names):
        length = _item_bytes(cols(world, i))
        index = MetadataIndex(name, torch.Size([rank * ROWS_PER_RANK, 0]), rank)
        results.append(WriteResult(index=index, size_in_bytes=length, storage_data=info(shard, offset, length)))
        records.append((offset, length, (rank * 7919 + offset) & 0xFFFFFFFF))
        offset += length
    blocks = [(rank + b) & 0xFFFFFFFF for b in range(-(-offset // BLOCK))]
    results.shard = (shard, FileRecord(size=offset, crc32=rank, items=records, block_size=BLOCK, blocks=blocks))
    return pickle.dumps(results)


class MemoryStorage:
    """The checkpoint directory in memory; the shard files, never written here, are listed
    with the sizes their records give."""

    uri = "memory://scale"

    def __init__(self, shard_sizes: dict[str, int]) -> None:
        self.files: dict[str, bytes] = {}
        self.shard_sizes = shard_sizes

    def exists(self) -> bool:
        return True

    def local_path(self, path: str = "") -> None:
        return None

    def write(self, path: str, data: bytes, *, durable: bool = True) -> None:
        self.files[path] = bytes(data)

    @contextlib.contextmanager
    def open_writer(self, path: str) -> Iterator[io.BytesIO]:
        stream = io.BytesIO()
        yield stream
        self.files[path] = stream.getvalue()

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.files[path]
        return data[offset:] if length is None else data[offset : offset + length]

    def list(self, prefix: str = "") -> dict[str, int]:
        shards = self.shard_sizes if ".metadata" in self.files else {}  # empty while the save prepares
        return {**shards, **{name: len(data) for name, data in self.files.items()}}

    def sync(self, paths: Any, names_only: Any = ()) -> None:
        pass

    def delete(self, paths: Any) -> None:
        for path in paths:
            self.files.pop(path, None)


def _shard_sizes(world: int, names: list[str]) -> dict[str, int]:
    per_rank = sum(_item_bytes(cols(world, i)) for i in range(len(names)))
    return {f"__{rank}_0.distcp": per_rank for rank in range(world)}


def coordinator_save(
    world: int, names: list[str], plans: list[bytes], results: list[bytes], reuse: PlanReuse
) -> tuple[dict[str, float], MemoryStorage, SavePlan]:
    """The coordinator's part of one save: seconds of the global plan, of everything between
    the gathered plans and the scatter, and of the records; the storage written; rank 0's plan."""
    with gc_paused():  # as `ckptlib.save` runs DCP
        return _coordinator_save(world, names, plans, results, reuse)


def _coordinator_save(world, names, plans, results, reuse) -> tuple[dict[str, float], MemoryStorage, SavePlan]:
    storage = MemoryStorage(_shard_sizes(world, names))
    transaction = SaveTransaction(storage, world_size=world)  # type: ignore[arg-type]
    writer = CkptWriter(storage, transaction=transaction)  # type: ignore[arg-type]
    writer.set_up_storage_writer(True)
    planner = CkptSavePlanner(reuse=reuse)
    planner.is_coordinator = True
    transaction.plan_timing = planner.timing
    started = time.perf_counter()
    gathered = [pickle.loads(plan) for plan in plans]  # DCP's gather decodes every rank's plan
    global_plans, metadata = planner.create_global_plan(gathered)
    central = writer.prepare_global_plan(global_plans)
    scattered = [pickle.dumps(plan) for plan in central]  # DCP's scatter
    own = pickle.loads(scattered[0])
    del gathered, global_plans, central, scattered  # DCP holds them until the scatter is done
    planned = time.perf_counter()
    all_results = [pickle.loads(r) for r in results]  # DCP's gather of the write results
    writer.finish(metadata, all_results)
    del all_results, metadata
    done = time.perf_counter()
    global_s = planner.timing.global_plan_s or 0.0
    return {"global_plan_s": global_s, "plan_s": planned - started, "records_s": done - planned}, storage, own


def open_for_load(storage: MemoryStorage) -> tuple[int, float, float]:
    """Rank 0 before a load: `open_checkpoint` (manifest, `.metadata` checked and unpickled,
    structure), then pickling what it broadcasts. (payload bytes, open s, pickling s)."""
    with gc_paused():  # as `ckptlib.load` runs
        started = time.perf_counter()
        info = open_checkpoint(storage)  # type: ignore[arg-type]
        opened = time.perf_counter()
        payload = pickle.dumps(("ok", info))
        return len(payload), opened - started, time.perf_counter() - opened


def load_plan(storage: MemoryStorage, names: list[str], rank: int, planner: str = "ckptlib", metadata=None) -> int:
    """One rank's reads for its chunk of every tensor (the resharding path, tensor by tensor, no
    layout reused): through ckptlib's `chunk_index.read_items` (the part of `local_load_plan`
    that depends on the world size) or DCP's `create_read_items_for_chunk_list`; returns the count."""
    if metadata is None:
        with gc_paused():
            metadata = pickle.loads(storage.files[".metadata"])
    reads = chunk_index.read_items if planner == "ckptlib" else create_read_items_for_chunk_list
    world = len(metadata.state_dict_metadata[names[0]].chunks)
    return sum(
        len(reads(name, metadata.state_dict_metadata[name], [chunk(rank, cols(world, i))]))
        for i, name in enumerate(names)
    )


def measure_load_plan(world: int, tensors: int) -> dict:
    """One rank's load plan alone (no save): the `.metadata` of the cell's layout built in
    memory (each tensor's chunks, one per rank), then the last rank's reads of every tensor
    through ckptlib's `chunk_index` and DCP's function; the process's peak resident memory."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    names = tensor_names(tensors)
    props = TensorProperties(dtype=torch.float32)
    with gc_paused():
        metadata = Metadata(
            state_dict_metadata={
                name: TensorStorageMetadata(
                    properties=props,
                    size=torch.Size([world * ROWS_PER_RANK, cols(world, i)]),
                    chunks=[chunk(rank, cols(world, i)) for rank in range(world)],
                )
                for i, name in enumerate(names)
            }
        )
    timings = {}
    for planner in ("ckptlib", "dcp"):
        started = time.perf_counter()
        count = load_plan(None, names, world - 1, planner, metadata)  # type: ignore[arg-type]
        timings[planner] = (time.perf_counter() - started, count)
    return {
        "world": world,
        "tensors": tensors,
        "chunks": world * tensors,
        "rank_load_plan_s": round(timings["ckptlib"][0], 4),
        "rank_load_plan_dcp_s": round(timings["dcp"][0], 4),
        "rank_reads": timings["ckptlib"][1],
        "rank_reads_dcp": timings["dcp"][1],
        "process_peak_mib": round(_rss()[1] / 2**20, 1),
    }


def _rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process; the peak resets with `_reset_peak`."""
    with open("/proc/self/status") as f:
        status = f.read()
    kib = {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM")}  # type: ignore[union-attr]
    return kib["VmRSS"] * 1024, kib["VmHWM"] * 1024


def _reset_peak() -> None:
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _first_save(world, names, plans, results, cache: PlanCache) -> tuple[dict, MemoryStorage]:
    reuse = PlanReuse(cache)
    timings, storage, own = coordinator_save(world, names, plans, results, reuse)
    cache.install(CachedPlan(b"bench", 1, own, reuse.skeleton))
    return timings, storage


def _second_save(world, names, results, cache: PlanCache) -> tuple[dict, MemoryStorage]:
    reuse = PlanReuse(cache)
    reuse.entry, reuse.hit = cache.entry, True  # what the agreement round decides for an unchanged state
    empty = [pickle.dumps(plan_codec.compact_save_plan(SavePlan([]))) for _ in range(world)]
    timings, storage, _ = coordinator_save(world, names, empty, results, reuse)
    return timings, storage


def measure_cell(world: int, tensors: int, dcp_max_chunks: int, traced_max_chunks: int = 300_000) -> dict:
    """Every figure of one cell (run it in a process of its own: the RSS peak is the cell's).
    The tracemalloc pass (a third save, slower) runs only up to `traced_max_chunks` chunks."""
    names = tensor_names(tensors)
    chunks = world * tensors
    plans = [rank_plan(world, names, rank) for rank in range(world)]
    results = [rank_results(world, names, rank) for rank in range(world)]
    cache = PlanCache()
    rss_before, _ = _rss()
    _reset_peak()
    first, storage = _first_save(world, names, plans, results, cache)
    peak = _rss()[1] - rss_before
    second, _ = _second_save(world, names, results, cache)
    # Python objects alive at the peak of a save (tracemalloc: exact, slower), and what the cache holds
    traced_peak = cached = None
    if chunks <= traced_max_chunks:
        cache.clear()
        tracemalloc.start()
        start = tracemalloc.get_traced_memory()[0]
        _first_save(world, names, plans, results, cache)
        traced_peak = tracemalloc.get_traced_memory()[1] - start
        cached = tracemalloc.get_traced_memory()[0] - start
        tracemalloc.stop()
    dcp_s = None
    if chunks <= dcp_max_chunks:
        gathered = [pickle.loads(plan) for plan in plans]
        started = time.perf_counter()
        DefaultSavePlanner().create_global_plan(gathered)
        dcp_s = time.perf_counter() - started
        del gathered
    payload, open_s, broadcast_s = open_for_load(storage)
    with gc_paused():  # as every rank unpickles what rank 0 broadcasts
        started = time.perf_counter()
        metadata = pickle.loads(storage.files[".metadata"])
        unpickle_s = time.perf_counter() - started
    started = time.perf_counter()
    reads = load_plan(storage, names, world - 1, "ckptlib", metadata)
    load_plan_s = time.perf_counter() - started
    started = time.perf_counter()
    dcp_reads = load_plan(storage, names, world - 1, "dcp", metadata)
    load_plan_dcp_s = time.perf_counter() - started
    del metadata
    process_peak = _rss()[1]  # since the last reset: the first save's start
    return {
        "world": world,
        "tensors": tensors,
        "chunks": chunks,
        "coordinator_plan_s": round(first["plan_s"] + first["records_s"], 4),
        "coordinator_plan_cached_s": round(second["plan_s"] + second["records_s"], 4),
        "global_plan_ckptlib_s": round(first["global_plan_s"], 4),
        "global_plan_cached_s": round(second["global_plan_s"], 6),
        "second_over_first": float(f"{second['plan_s'] / first['plan_s']:.3g}"),
        "global_plan_dcp_s": None if dcp_s is None else round(dcp_s, 4),
        "coordinator_peak_mib": round(peak / 2**20, 1),
        "bytes_per_chunk": round(peak / chunks),
        "traced_bytes_per_chunk": None if traced_peak is None else round(traced_peak / chunks),
        "cached_bytes_per_chunk": None if cached is None else round(cached / chunks),
        "metadata_bytes": len(storage.files[".metadata"]),
        "manifest_bytes": len(storage.files["ckptlib.json"]),
        "coordinator_open_s": round(open_s + broadcast_s, 4),
        "open_us_per_chunk": round((open_s + broadcast_s) / chunks * 1e6, 2),
        "broadcast_bytes": payload,
        "rank_metadata_unpickle_s": round(unpickle_s, 4),
        "rank_load_plan_s": round(load_plan_s, 4),
        "rank_load_plan_dcp_s": round(load_plan_dcp_s, 4),
        "rank_reads": reads,
        "rank_reads_dcp": dcp_reads,
        "process_peak_mib": round(process_peak / 2**20, 1),
    }


__all__ = [
    "MemoryStorage",
    "coordinator_save",
    "measure_cell",
    "measure_load_plan",
    "open_for_load",
    "rank_plan",
    "rank_results",
]
