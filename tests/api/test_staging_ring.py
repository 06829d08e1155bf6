"""The pieces of `AsyncMode(max_staging_bytes=N)` at their bounds, single process (the saves are
in tests/api/test_async_staging_cap.py): the staging ring places pieces first in first out,
64-byte aligned, using its space up to the last byte (a piece ending exactly at the ring's end
or at the oldest piece held, a wrap to the start that fills exactly the freed space) and its
peak is the most bytes held at once; a capped save's ring is the largest tensor (thread) or
min(cap, the shard) (writer process) and is never reused at another size; the tensor sizes are
each tensor's own bytes; the refusal names the largest tensor over the cap; the shared-memory
arena takes a span that fits exactly, rounds segments up to whole MiB and merges freed spans."""

from __future__ import annotations

import pytest
import torch

from ckptlib import StagingCapError
from ckptlib.saving import capped_staging, staging_arena
from ckptlib.saving.capped_staging import StagingRing, check_fits, ring_for, tensor_sizes

needs_memfd = pytest.mark.skipif(
    staging_arena.unavailable_reason() is not None, reason=str(staging_arena.unavailable_reason())
)
MIB = 1 << 20


def _bytes(n: int, fill: int = 1) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.uint8)


class Ring:
    """A StagingRing and the offsets of the pieces it gives."""

    def __init__(self, size: int):
        self.ring = StagingRing(size)
        self.base = None
        self.pieces: list[torch.Tensor] = []

    def put(self, n: int, fill: int = 1) -> int | None:
        piece = self.ring.put(_bytes(n, fill))
        if piece is None:
            return None
        if self.base is None:
            self.base = piece.data_ptr()
        self.pieces.append(piece)
        assert torch.equal(piece, _bytes(n, fill))
        return piece.data_ptr() - self.base

    def free(self) -> None:
        self.pieces.pop(0)
        self.ring.free_oldest()


@pytest.fixture
def ring():
    made: list[Ring] = []

    def make(size: int) -> Ring:
        made.append(Ring(size))
        return made[-1]

    yield make
    for r in made:
        r.pieces.clear()
        r.ring.close()


def test_pieces_are_aligned_and_the_last_one_may_end_at_the_ring_s_end(ring):
    r = ring(256)
    assert r.put(10) == 0
    assert r.put(10) == 64  # aligned
    assert r.put(128) == 128  # ends exactly at 256
    assert r.put(1) is None  # full until the oldest is freed
    assert (r.ring.held, r.ring.peak) == (148, 148)


def test_a_wrap_fills_exactly_the_space_the_oldest_pieces_left(ring):
    r = ring(256)
    assert [r.put(128), r.put(64)] == [0, 128]
    r.free()  # [0, 128) free again; head at 192
    assert r.put(129) is None  # neither after the head nor before the oldest
    assert r.put(128) == 0  # exactly the freed span, at the start
    assert r.ring.peak == 192


def test_a_piece_may_end_exactly_at_the_oldest_piece_held(ring):
    r = ring(256)
    assert [r.put(64, i) for i in range(4)] == [0, 64, 128, 192]
    r.free()
    r.free()  # the oldest held is at 128
    assert r.put(64, 7) == 0
    assert r.put(64, 8) == 64  # [64, 128): up to the oldest exactly
    assert r.put(1) is None
    assert [int(p[0]) for p in r.pieces] == [2, 3, 7, 8]  # nothing overwritten


def test_peak_is_the_most_bytes_held_at_once_since_begin(ring):
    r = ring(1024)
    r.put(100)
    r.put(300)
    r.free()
    r.put(200)
    assert (r.ring.held, r.ring.peak) == (500, 500)
    r.free()
    r.free()
    assert r.ring.held == 0 and r.ring.peak == 500
    r.ring.begin()
    r.put(64)
    assert r.ring.peak == 64


def test_a_piece_larger_than_the_ring_never_fits(ring):
    r = ring(100)
    assert r.put(101) is None
    assert r.put(100) == 0


def test_tensor_sizes_are_each_tensor_s_own_bytes():
    base = torch.zeros(10, 10)
    state = {
        "row": base[3],  # a view: 40 bytes, not the 400 of its storage
        "t": torch.zeros(3, 5).t(),
        "half": torch.zeros(7, dtype=torch.bfloat16),
        "nested": {"list": [torch.zeros(2, dtype=torch.int64), {"x": torch.zeros(1, dtype=torch.float64)}]},
        "sparse": torch.zeros(4, 4).to_sparse(),  # written as it is: not staged
        "obj": {"epoch": 3},
    }
    assert tensor_sizes(state) == {"row": 40, "t": 60, "half": 14, "nested.list[0]": 16, "nested.list[1].x": 8}


def test_the_refusal_names_the_largest_tensor_over_the_cap():
    sizes = {"a": 200, "b": 500, "c": 50, "d": 300}
    with pytest.raises(StagingCapError) as info:
        check_fits(sizes, 100, rank=3, where="/ckpt")
    assert str(info.value) == (
        "tensor 'b' on rank 3 is 500 bytes, more than AsyncMode(max_staging_bytes=100): a capped save stages whole "
        "tensors (raise the cap to at least 500, or shard the tensor); nothing was written to /ckpt"
    )
    assert (info.value.key, info.value.nbytes, info.value.cap, info.value.rank, info.value.path) == (
        "b",
        500,
        100,
        3,
        "/ckpt",
    )
    check_fits(sizes, 500, rank=0, where="/ckpt")  # exactly the cap fits


def test_a_thread_writer_s_ring_is_the_largest_tensor_and_is_resized_for_another_state():
    try:
        assert ring_for("g", 10_000, {"a": 100, "b": 1000}).size == 1000
        assert ring_for("g", 10_000, {"a": 100, "b": 1000}).size == 1000
        assert ring_for("g", 10_000, {"a": 3000}).size == 3000
        assert ring_for("g", 10_000, {}).size == 1
    finally:
        capped_staging.release()


@needs_memfd
def test_a_writer_process_s_ring_is_min_of_the_cap_and_the_aligned_shard():
    arena = staging_arena.StagingArena()
    try:
        assert ring_for("g", 10_000, {"a": 100, "b": 1000}, arena).size == 128 + 1024
        assert arena.mapped_bytes() == 128 + 1024  # one exact segment
        assert ring_for("g", 500, {"a": 100, "b": 1000}, arena).size == 500
        assert arena.mapped_bytes() == 500  # the other size's segment given back
        assert ring_for("g", 1 << 30, {"a": 64, "b": 64}, arena).size == 128
    finally:
        capped_staging.release()
        arena.close()


@needs_memfd
def test_the_arena_takes_an_exact_span_rounds_segments_to_mib_and_merges_freed_spans():
    arena = staging_arena.StagingArena()
    try:
        whole = arena.tensor((MIB,), torch.uint8)  # exactly one MiB: one segment, all of it
        assert (len(arena.segments), arena.mapped_bytes()) == (1, MIB)
        arena.release(whole)
        del whole
        small = [arena.tensor((64,), torch.uint8) for _ in range(3)]  # in the same segment
        assert (len(arena.segments), arena.mapped_bytes()) == (1, MIB)
        for t in (small[1], small[0], small[2]):
            arena.release(t)
        del small, t
        (segment,) = arena.segments.values()
        assert segment.free == [[0, MIB]] and segment.live == 0
        again = arena.tensor((MIB,), torch.uint8)  # the merged span holds a whole MiB again
        assert (len(arena.segments), arena.mapped_bytes()) == (1, MIB)
        arena.release(again)
        del again
        odd = arena.tensor((MIB + 1,), torch.uint8)  # rounded up to whole MiB
        assert arena.mapped_bytes() == MIB + 2 * MIB
        arena.release(odd)
        del odd
    finally:
        arena.close()
