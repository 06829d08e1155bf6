"""Coordinator-side cost of a checkpoint at simulated scale, without spawning ranks (issue 13).

For each (world size, tensor count) it builds what the save and load of a transformer-shaped
state row-sharded over every rank would build: each rank's SavePlan (one chunk per tensor),
DCP's global save plan and Metadata (DefaultSavePlanner.create_global_plan: dedup, index
hints, overlap validation), the pickled `.metadata` with one storage record per chunk,
ckptlib's manifest (a FileRecord per shard file, one item record per chunk), and one rank's
load plan (DCP's resharding reads for its chunk of every tensor).

Run: ckpt bench scale (or python -m benchmarks.scale) [--worlds 8,64,512,4096] [--tensors 1000,10000,100000]
                                [--max-chunks N] [--json]
Cells with more than --max-chunks chunks (world x tensors) are skipped (reported as such).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import tracemalloc

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlib import compat
from ckptlib.format.manifest import FileRecord, Manifest

ROWS_PER_RANK, COLS = 4, 64  # every tensor: (world * 4, 64) float32, row-sharded


def _tensor_names(count: int) -> list[str]:
    return [f"model.layers.{i // 16}.param{i % 16}.weight" for i in range(count)]


def _chunk(rank: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([rank * ROWS_PER_RANK, 0]), sizes=torch.Size([ROWS_PER_RANK, COLS]))


def _save_plans(world: int, names: list[str]) -> list[SavePlan]:
    size = torch.Size([world * ROWS_PER_RANK, COLS])
    props = TensorProperties(dtype=torch.float32)
    plans = []
    for rank in range(world):
        chunk = _chunk(rank)
        items = [
            WriteItem(
                index=MetadataIndex(name, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
            )
            for name in names
        ]
        plans.append(SavePlan(items, planner_data={name: (name,) for name in names}))
    return plans


def _plan_and_write_records(world: int, names: list[str]) -> tuple[bytes, bytes]:
    """Global planning on the coordinator, then the `.metadata` and manifest bytes it writes."""
    plans = _save_plans(world, names)
    planner = DefaultSavePlanner()
    global_plans, metadata = planner.create_global_plan(plans)
    storage_info = compat.storage_info_cls()
    item_bytes = 800 + ROWS_PER_RANK * COLS * 4  # a torch.save archive of one chunk, roughly
    storage_data = {}
    files = {}
    for rank, plan in enumerate(global_plans):
        name = f"__{rank}_0.distcp"
        items = []
        for i, item in enumerate(plan.items):
            storage_data[item.index] = storage_info(name, i * item_bytes, item_bytes)
            items.append((i * item_bytes, item_bytes, (rank * 7919 + i) & 0xFFFFFFFF))
        size = len(items) * item_bytes
        blocks = [(rank + b) & 0xFFFFFFFF for b in range(-(-size // (1 << 20)))]
        files[name] = FileRecord(size=size, crc32=rank, items=items, block_size=1 << 20, blocks=blocks)
    metadata.storage_data = storage_data
    return pickle.dumps(metadata), Manifest(world_size=world, files=files).to_bytes()


def _load_plan(metadata_blob: bytes, names: list[str], rank: int) -> int:
    """One rank's reads for its chunk of every tensor (DCP's resharding path); returns the count."""
    metadata = pickle.loads(metadata_blob)
    local = [_chunk(rank)]
    return sum(len(create_read_items_for_chunk_list(name, metadata.state_dict_metadata[name], local)) for name in names)


def measure(world: int, tensors: int) -> dict:
    names = _tensor_names(tensors)
    start = time.perf_counter()
    metadata_blob, manifest_blob = _plan_and_write_records(world, names)
    plan_s = time.perf_counter() - start
    tracemalloc.start()
    _plan_and_write_records(world, names)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    start = time.perf_counter()
    reads = _load_plan(metadata_blob, names, world - 1)
    load_plan_s = time.perf_counter() - start
    return {
        "world": world, "tensors": tensors, "chunks": world * tensors,
        "coordinator_plan_s": round(plan_s, 4), "coordinator_peak_mib": round(peak / 2**20, 2),
        "metadata_bytes": len(metadata_blob), "manifest_bytes": len(manifest_blob),
        "rank_load_plan_s": round(load_plan_s, 4), "rank_reads": reads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckpt bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,64,512,4096")
    parser.add_argument("--tensors", default="1000,10000,100000")
    parser.add_argument("--max-chunks", type=int, default=200_000)
    parser.add_argument("--json", action="store_true", help="one JSON object per cell on stdout")
    args = parser.parse_args(argv)
    for world in (int(w) for w in args.worlds.split(",")):
        for tensors in (int(t) for t in args.tensors.split(",")):
            if world * tensors > args.max_chunks:
                row = {"world": world, "tensors": tensors, "skipped": f"{world * tensors} chunks > --max-chunks"}
            else:
                row = measure(world, tensors)
            print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
