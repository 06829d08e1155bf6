"""One rank's reads of a tensor at the cost of the saved chunks it reads, not of every chunk.

DCP's `create_read_items_for_chunk_list` sorts and sweeps every chunk saved of the tensor for
each rank (one chunk per saving rank: at 16,384 ranks x 100 tensors, one rank's load plan
walks 1.6 million chunks). Here the saved chunks a local chunk reads are found by bisecting
the saved chunks on their start along dimension 0 (they are in that order in every
row-sharded save) and walking back from the first chunk that starts past the local chunk's
end until the chunks found cover the local chunk's whole volume; DCP's own function then
runs on those chunks alone, and its read items name the chunks by their index in the whole
list, as DCP's run over every chunk names them (the same items in the same order).

Saved chunks never overlap each other (DCP's and ckptlib's save planners refuse a plan where
they do), so chunks that cover the local chunk are all the chunks it reads. Where they do
not cover it (chunks out of order, a gap, a tensor without dimensions), every chunk is a
candidate: DCP's cost, and DCP's answer.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlib.format.native.plan_codec import new_dataclass


def _start(chunk: ChunkStorageMetadata) -> int:
    return chunk.offsets[0]


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> int:
    """Elements `a` and `b` share."""
    volume = 1
    for offset_a, size_a, offset_b, size_b in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        extent = min(offset_a + size_a, offset_b + size_b) - max(offset_a, offset_b)
        if extent <= 0:
            return 0
        volume *= extent
    return volume


def _covering(chunks: list[ChunkStorageMetadata], local: ChunkStorageMetadata) -> list[int] | None:
    """Indices of the saved chunks that share elements with `local`, found walking back from
    the first chunk that starts at or past its end; None when they do not cover it."""
    need = 1
    for size in local.sizes:
        need *= size
    if need == 0:
        return []  # an empty chunk reads nothing (DCP: no overlap)
    found, covered = [], 0
    i = bisect.bisect_left(chunks, local.offsets[0] + local.sizes[0], key=_start) - 1
    while i >= 0 and covered < need:
        shared = _overlap(chunks[i], local)
        if shared:
            found.append(i)
            covered += shared
        i -= 1
    return found if covered == need else None


def candidates(md: TensorStorageMetadata, local_chunks: Sequence[ChunkStorageMetadata]) -> list[int]:
    """Indices, ascending, of the saved chunks of `md` that some local chunk reads (every
    index where the bisection cannot show it has found them all)."""
    chunks = md.chunks
    if not local_chunks:
        return []
    if not len(md.size) or len(local_chunks[0].offsets) != len(md.size):
        return list(range(len(chunks)))
    picked: set[int] = set()
    for local in local_chunks:
        found = _covering(chunks, local)
        if found is None:
            return list(range(len(chunks)))
        picked.update(found)
    return sorted(picked)


def read_items(
    fqn: str,
    md: TensorStorageMetadata,
    local_chunks: Sequence[ChunkStorageMetadata],
    picked: list[int] | None = None,
) -> list[ReadItem]:
    """DCP's `create_read_items_for_chunk_list(fqn, md, local_chunks)`, item for item, at the
    cost of the saved chunks read (`picked`: `candidates(md, local_chunks)`, computed if None)."""
    if picked is None:
        picked = candidates(md, local_chunks)
    if len(picked) == len(md.chunks):
        return create_read_items_for_chunk_list(fqn, md, list(local_chunks))
    narrowed = TensorStorageMetadata(properties=md.properties, size=md.size, chunks=[md.chunks[i] for i in picked])
    items = create_read_items_for_chunk_list(fqn, narrowed, list(local_chunks))
    return [_renumbered(item, picked[item.storage_index.index]) for item in items]


def _renumbered(item: ReadItem, index: int) -> ReadItem:
    storage = item.storage_index
    return new_dataclass(
        ReadItem,
        {**item.__dict__, "storage_index": new_dataclass(type(storage), {**storage.__dict__, "index": index})},
    )


__all__ = ["candidates", "read_items"]
