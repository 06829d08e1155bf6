"""format.read.chunk_index: one rank's reads of a tensor are DCP's, item for item and index for
index, at the cost of the saved chunks it reads (counted accesses, never timed)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlib.format.read import chunk_index


def _chunk(offsets, sizes) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _rows(total: int, parts: int, cols: tuple[int, ...] = (5,)) -> list[ChunkStorageMetadata]:
    """`torch.chunk`'s split of `total` rows into `parts` (the last ones may be empty), as
    DTensor's Shard(0) lays them out."""
    step = -(-total // parts)
    out = []
    for p in range(parts):
        begin = min(total, p * step)
        end = min(total, begin + step)
        out.append(_chunk((begin,) + (0,) * len(cols), (end - begin,) + cols))
    return out


def _grid(rows: int, cols: int, row_parts: int, col_parts: int) -> list[ChunkStorageMetadata]:
    r, c = rows // row_parts, cols // col_parts
    return [_chunk((i * r, j * c), (r, c)) for i in range(row_parts) for j in range(col_parts)]


def _md(size, chunks) -> TensorStorageMetadata:
    return TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size), chunks=chunks)


def _shuffled(chunks):
    out = list(chunks)
    random.Random(3).shuffle(out)
    return out


# (saved size, saved chunks, every loading rank's local chunks)
LAYOUTS = {
    "rows-8-to-3": ((24, 5), _rows(24, 8), [[c] for c in _rows(24, 3)]),
    "rows-3-to-8": ((24, 5), _rows(24, 3), [[c] for c in _rows(24, 8)]),
    "rows-uneven-with-empty": ((10, 5), _rows(10, 4), [[c] for c in _rows(10, 3)]),
    "rows-1d": ((64,), _rows(64, 16, ()), [[c] for c in _rows(64, 5, ())]),
    "columns": (
        (6, 32),
        [_chunk((0, 4 * j), (6, 4)) for j in range(8)],
        [[_chunk((0, 8 * j), (6, 8))] for j in range(4)],
    ),
    "grid-2x4-to-rows": ((8, 16), _grid(8, 16, 2, 4), [[c] for c in _rows(8, 4, (16,))]),
    "grid-2x4-to-4x2": ((8, 16), _grid(8, 16, 2, 4), [[c] for c in _grid(8, 16, 4, 2)]),
    "two-local-chunks": ((32, 4), _rows(32, 8, (4,)), [[_chunk((0, 0), (4, 4)), _chunk((20, 0), (9, 4))]]),
    "unsorted-rows": ((24, 5), _shuffled(_rows(24, 8)), [[c] for c in _rows(24, 3)]),
    "gap": ((24, 5), [c for i, c in enumerate(_rows(24, 8)) if i != 4], [[c] for c in _rows(24, 3)]),
    "empty-local": ((24, 5), _rows(24, 8), [[_chunk((24, 0), (0, 5))]]),
    "scalar": ((), [_chunk((), ())], [[_chunk((), ())]]),
}


def _exact(items):
    """Read items with the indices their equality ignores (MetadataIndex.index)."""
    return [(item, item.storage_index.index, item.dest_index.index) for item in items]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reads_are_dcps_item_for_item(layout):
    size, saved, ranks = LAYOUTS[layout]
    md = _md(size, saved)
    for local in ranks:
        expected = create_read_items_for_chunk_list("w", md, local)
        assert _exact(chunk_index.read_items("w", md, local)) == _exact(expected)
        picked = chunk_index.candidates(md, local)
        assert {item.storage_index.index for item in expected} <= set(picked)


@pytest.mark.parametrize(
    "layout, rank, expected",
    [
        ("rows-8-to-3", 0, [0, 1, 2]),  # rows 0-7 of 24: saved rows 0-2, 3-5, 6-8
        ("rows-8-to-3", 2, [5, 6, 7]),
        ("rows-uneven-with-empty", 2, [2, 3]),  # rows 8-9 of 10; saved rows 0-2, 3-5, 6-8, 9
        ("grid-2x4-to-rows", 1, [0, 1, 2, 3]),
        ("unsorted-rows", 0, [0, 3, 4]),  # out of order: the walk back still finds what covers rows 0-7
        ("unsorted-rows", 2, [1, 2, 5]),  # ... walking back over every chunk (DCP's cost)
        ("gap", 1, list(range(7))),  # rows 8-15 miss saved rows 12-14: every chunk
        ("empty-local", 0, []),
    ],
    ids=["first-rank", "last-rank", "uneven", "grid", "unsorted-first", "unsorted-last", "gap-all", "empty"],
)
def test_candidates_are_the_chunks_read(layout, rank, expected):
    size, saved, ranks = LAYOUTS[layout]
    assert chunk_index.candidates(_md(size, saved), ranks[rank]) == expected


class _CountingList(list):
    """The saved chunks, counting every element read."""

    reads = 0

    def __getitem__(self, index):
        type(self).reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("world", [64, 4096, 65536], ids=["world64", "world4096", "world65536"])
def test_one_ranks_reads_touch_its_chunks_not_the_world(world):
    """A rank of a same-world load reads one chunk: the bisection and the walk back touch
    O(log world) saved chunks, where DCP's sweep touches every one."""
    chunks = _CountingList(_rows(4 * world, world, (8,)))
    md = _md((4 * world, 8), chunks)
    local = [_chunk((4 * (world - 2), 0), (4, 8))]
    _CountingList.reads = 0
    items = chunk_index.read_items("w", md, local)
    assert [item.storage_index.index for item in items] == [world - 2]
    assert _CountingList.reads <= 2 * world.bit_length() + 4


class _CountingChunks(list):
    """Saved chunks counting every element read, by index or by iteration."""

    reads = 0

    def __getitem__(self, index):
        type(self).reads += 1
        return super().__getitem__(index)

    def __iter__(self):
        type(self).reads += len(self)
        return super().__iter__()


def _plan_of_many_chunks(saved: int) -> dict:
    """Rank body (2 ranks): `local_load_plan` of DTensors Shard(0) of one shape: "w" saved in
    `saved` row chunks, "v" in 8, "u" in `saved` again: their reads (DCP's, exactly), and how
    many saved chunks of "w" the plan touched."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptlib.format.read.load_planner import local_load_plan

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    rows = 2 * saved
    state = {
        name: DTensor.from_local(
            torch.zeros(rows // 2, 3), mesh, [Shard(0)], run_check=False, shape=(rows, 3), stride=(3, 1)
        )
        for name in ("w", "v", "u")
    }
    chunks = _CountingChunks(_rows(rows, saved, (3,)))
    layouts = {"w": chunks, "v": _rows(rows, 8, (3,)), "u": _rows(rows, saved, (3,))}
    metadata = Metadata(state_dict_metadata={name: _md((rows, 3), c) for name, c in layouts.items()})
    _CountingChunks.reads = 0
    items = local_load_plan({"w": state["w"]}, metadata, True).items
    touched = _CountingChunks.reads
    local = [_chunk((rank * saved, 0), (saved, 3))]
    expected = {
        name: create_read_items_for_chunk_list(name, _md((rows, 3), list(c)), local) for name, c in layouts.items()
    }
    every = local_load_plan(state, metadata, True).items  # "u" reuses the reads of "w" (same layout), "v" cannot
    return {
        "same": _exact(items) == _exact(expected["w"]),
        "all same": _exact(every) == _exact(expected["w"] + expected["v"] + expected["u"]),
        "reads": len(items),
        "touched": touched,
    }


def test_local_load_plan_touches_the_chunks_it_reads_not_every_chunk():
    """Each of 2 ranks reads half of 4,096 saved chunks: the plan touches each chunk it reads
    at most 4 times and no other (before: 20,481 touches, every chunk 5 times, the template key
    and DCP's sweep over every chunk); tensors of one shape saved in other chunks get their own
    reads, those saved alike reuse them."""
    from ckptlib.testing import launch

    for result in launch(2, _plan_of_many_chunks, 4096, timeout=180):
        assert result["same"] and result["all same"] and result["reads"] == 2048
        assert result["touched"] <= 4 * 2048 + 64  # the walk back, the key (offsets, sizes), the narrowed list
