"""The read schedule of a load, a pure function (no process group): which rank reads each stored
item from storage, who it sends it to, and in which round. `ckpt plan` calls it to predict a
load's reads; the load's coordinator to plan them."""

from __future__ import annotations

import pytest

from ckptlib import CopiesExhaustedError, CopiesMissingError, NoCopyError
from ckptlib.format.read.read_schedule import RankRequests, schedule_reads

MIB = 1 << 20


def _items(*keys, partial: dict | None = None) -> dict:
    return {key: (partial or {}).get(key, key[2]) for key in keys}


def test_replicated_items_are_read_once_spread_by_bytes():
    """DDP at 4 ranks: every rank needs every item; each item gets one reader, the readers'
    bytes are balanced (neighbours up to a quarter of the bytes make a run, runs go largest
    first to the least-loaded rank), the others receive it."""
    sizes = [8 * MIB, 4 * MIB, 4 * MIB, 2 * MIB, 2 * MIB, 1]
    keys, offset = [], 0
    for n in sizes:
        keys.append(("__0_0.distcp", offset, n))
        offset += n
    plan = schedule_reads([RankRequests(_items(*keys)) for _ in range(4)])
    assert sorted(plan.readers) == sorted(keys)
    assert [plan.readers[k] for k in keys] == [0, 2, 3, 1, 1, 1]  # 2+2 MiB+1 byte is one run, larger than 4 MiB
    for key, reader in plan.readers.items():
        assert plan.receivers[key] == tuple(r for r in range(4) if r != reader)
    assert plan.bytes_needed == sum(sizes)
    assert sum(plan.storage_bytes()) == plan.bytes_needed
    assert plan.direct == [{}, {}, {}, {}]


def test_many_small_items_make_one_contiguous_block_per_reader():
    """8 ranks, 800 items of 40 KB in two files: each rank reads one range of 100 adjacent
    items (one block: one read, one message per receiver), not 100 scattered ones."""
    size = 40_000
    keys = [(f"__{f}_0.distcp", i * size, size) for f in (0, 1) for i in range(400)]
    plan = schedule_reads([RankRequests(_items(*keys)) for _ in range(8)])
    assert plan.storage_bytes() == [100 * size] * 8
    blocks = [block for blocks in plan.rounds for block in blocks]
    assert len(blocks) == 8 and sorted(block[0] for block in blocks) == list(range(8))
    for reader, receivers, items in blocks:
        assert len(items) == 100 and items[-1][1] - items[0][1] == 99 * size
        assert receivers == tuple(r for r in range(8) if r != reader)


def test_a_small_checkpoint_is_not_cut_into_world_times_world_messages():
    """At 64 ranks and 400 KB to share, one rank reads it all (MIN_RUN): 63 messages, not 64 x 63."""
    keys = [("__0_0.distcp", i * 1000, 1000) for i in range(400)]
    plan = schedule_reads([RankRequests(_items(*keys)) for _ in range(64)])
    assert [len(blocks) for blocks in plan.rounds] == [1] and sum(plan.storage_bytes()) == 400_000


def test_disjoint_reads_of_one_item_stay_where_they_are():
    """A reshard: two ranks need different rows of one stored item (together no more than it
    holds): each reads its own rows, nothing is shared."""
    key = ("__0_0.distcp", 0, 8 * MIB)
    plan = schedule_reads([RankRequests({key: 4 * MIB}), RankRequests({key: 4 * MIB})])
    assert plan.readers == {} and plan.rounds == []
    assert plan.direct == [{key: 4 * MIB}, {key: 4 * MIB}]
    assert plan.storage_bytes() == [4 * MIB, 4 * MIB]


def test_overlapping_partial_reads_are_shared():
    key = ("__0_0.distcp", 0, 8 * MIB)
    plan = schedule_reads([RankRequests({key: 6 * MIB}), RankRequests({key: 6 * MIB})])
    assert plan.readers == {key: 0} and plan.receivers == {key: (1,)}
    assert plan.storage_bytes() == [8 * MIB, 0]


def test_without_read_once_every_rank_reads_what_it_needs():
    key = ("__0_0.distcp", 0, MIB)
    plan = schedule_reads([RankRequests({key: MIB}) for _ in range(4)], read_once=False)
    assert plan.readers == {} and plan.storage_bytes() == [MIB] * 4
    assert plan.bytes_needed == MIB


def test_a_rank_without_a_copy_receives_from_one_with_it():
    """Node-local copies: rank 2 and 3 (node 1) hold only __1_0.distcp; rank 0's items come to
    them from node 0, even with read_once off."""
    a, b = ("__0_0.distcp", 0, MIB), ("__1_0.distcp", 0, 2 * MIB)
    node0, node1 = frozenset({"__0_0.distcp"}), frozenset({"__1_0.distcp"})
    requests = [RankRequests.reading({a: MIB, b: 2 * MIB}, readable) for readable in (node0, node0, node1, node1)]
    for read_once in (True, False):
        plan = schedule_reads(requests, read_once=read_once)
        assert plan.readers[a] in (0, 1) and plan.readers[b] in (2, 3), read_once
        expected = {0, 1, 2, 3} if read_once else {plan.readers[a], 2, 3}  # without: node 0 reads for itself
        assert sorted(plan.receivers[a]) == sorted(expected - {plan.readers[a]})
        assert sum(plan.storage_bytes()) == (3 * MIB if read_once else 6 * MIB)  # each node reads its own
    # a file nobody requesting it can read is read by any rank that can
    plan = schedule_reads([RankRequests.reading({a: MIB}, node1), RankRequests.reading({}, node0)])
    assert plan.readers == {a: 1} and plan.receivers == {a: (0,)} and plan.storage_bytes() == [0, MIB]


def test_no_copy_anywhere_is_named():
    a = ("__0_0.distcp", 0, MIB)
    none = frozenset()
    with pytest.raises(NoCopyError, match=r"no rank of this load has a copy of __0_0.distcp \(rank 0's shard\)"):
        schedule_reads([RankRequests.reading({a: MIB}, none), RankRequests.reading({a: MIB}, none)])
    tried = {
        "__0_0.distcp": [
            ("local", "/n0/__0_0.distcp", "checksum mismatch"),
            ("remote", "s3://b/__0_0.distcp", "missing"),
        ]
    }
    with pytest.raises(CopiesExhaustedError, match="every copy of __0_0.distcp .* local /n0/__0_0.distcp: checksum"):
        schedule_reads([RankRequests.reading({a: MIB}, none)], tried=tried)
    with pytest.raises(CopiesMissingError):
        schedule_reads(
            [RankRequests.reading({a: MIB}, none)], tried={"__0_0.distcp": [("remote", "s3://b/x", "missing")]}
        )


def test_rounds_bound_what_a_rank_holds():
    keys = [("__0_0.distcp", i * 3 * MIB, 3 * MIB) for i in range(6)] + [("__1_0.distcp", 0, 20 * MIB)]
    plan = schedule_reads([RankRequests(_items(*keys)) for _ in range(2)], round_bytes=8 * MIB)
    assert [block[2] for block in plan.rounds[0]] == [(keys[-1],)]  # larger than a round: alone
    for blocks in plan.rounds[1:]:
        held = [0, 0]
        for reader, receivers, items in blocks:
            for rank in (reader, *receivers):
                held[rank] += sum(k[2] for k in items)
        assert max(held) <= 8 * MIB
    assert sorted(k for blocks in plan.rounds for block in blocks for k in block[2]) == sorted(keys)
    roles = plan.roles()
    for rank in range(2):
        assert roles[rank].shared == frozenset(keys)
        for part in roles[rank].rounds:
            assert all(block[0] == rank for block in part.out) and all(block[0] == 1 - rank for block in part.into)


def test_every_item_comes_from_the_nearest_copy_any_rank_holds():
    """Two nodes, each holding its own file locally (cost 0), every rank also the remote (cost
    2): items are read on the node that holds them, never from the remote, even an item only
    a rank of the other node needs; a file no node holds comes from the remote, read once."""
    a, b, c = ("__0_0.distcp", 0, 2 * MIB), ("__2_0.distcp", 0, 2 * MIB), ("__9_0.distcp", 0, MIB)
    only = ("__0_0.distcp", 2 * MIB, MIB)  # rank 3 alone needs it (a resize)
    node0, node1 = {"__0_0.distcp": 0}, {"__2_0.distcp": 0}
    requests = [RankRequests({a: 2 * MIB, b: 2 * MIB, c: MIB}, costs, 2) for costs in (node0, node0, node1, node1)]
    requests[3] = RankRequests({**requests[3].items, only: MIB}, node1, 2)
    plan = schedule_reads(requests)
    assert plan.readers[a] in (0, 1) and plan.readers[b] in (2, 3)
    assert plan.readers[only] in (0, 1) and plan.receivers[only] == (3,)
    assert plan.direct == [{}, {}, {}, {}] and len(plan.receivers[c]) == 3
    assert sum(plan.storage_bytes()) == plan.bytes_needed == 6 * MIB


def test_no_read_through_gaps_where_another_rank_reads():
    """FSDP2+TP-like: rank 0's own items in its file lie around a replicated item rank 1 reads
    (shared): on an object store rank 0 must not coalesce its reads over it (RankRole.tight);
    rank 1, whose file holds only its own items, may."""
    mine = [("__0_0.distcp", 0, MIB), ("__0_0.distcp", 3 * MIB, MIB)]
    norm = ("__0_0.distcp", MIB, 2 * MIB)
    theirs = ("__1_0.distcp", 0, MIB)
    plan = schedule_reads([RankRequests({**_items(*mine), norm: 2 * MIB}), RankRequests({theirs: MIB, norm: 2 * MIB})])
    assert plan.readers == {norm: 1}
    assert plan.tight == [frozenset({"__0_0.distcp"}), frozenset()]
    assert [role.tight for role in plan.roles()] == plan.tight
