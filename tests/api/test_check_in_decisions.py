"""The check-in's decisions (`ckptlib._runtime.check_in`) on a store and a clock the test
drives, single process: the last rank in never waits, a one-rank group touches nothing, the
grace is exact, a missing rank is lost only once its heartbeat stood still for three periods
(never when it never beat, never while it beats late), the first MAX_LOOKED_AT missing ranks'
heartbeats are read, and two groups of one size never share a check-in. The gloo runs are in
tests/api/test_check_in.py."""

from __future__ import annotations

import types
from typing import Callable

import pytest
import torch.distributed as dist

from ckptlib import NotCalledByEveryRankError, RankLostError
from ckptlib._runtime import check_in as check_in_module
from ckptlib._runtime.check_in import check_in

BEAT = ("hb", 1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 500.0


class FakeStore:
    """The store calls check_in makes; `wait` finds what is set or times out after moving the
    clock by its timeout. `beats[r](elapsed)` is rank r's heartbeat count `elapsed` seconds
    into the call (missing: 0, a rank that never started one)."""

    def __init__(self, clock: Clock, beats: dict[int, Callable[[float], int]] | None = None, max_waits: int = 1000):
        self.clock, self.start = clock, clock.now
        self.beats = beats or {}
        self.data: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}
        self.waits = 0
        self.max_waits = max_waits

    def append(self, key: str, value: str) -> None:
        self.data[key] = self.data.get(key, b"") + value.encode()

    def add(self, key: str, amount: int) -> int:
        if key.startswith(BEAT[0] + "/"):
            fn = self.beats.get(int(key.rsplit("/", 1)[1]))
            return 0 if fn is None else fn(self.clock.now - self.start)
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def wait(self, keys, timeout) -> None:
        self.waits += 1
        if self.waits > self.max_waits:  # a check-in that would never end: the store goes away
            raise RuntimeError("store closed")
        if all(k in self.data for k in keys):
            return
        self.clock.now += timeout.total_seconds()
        raise RuntimeError("Socket Timeout")

    def keys(self) -> set[str]:
        return set(self.data) | set(self.counts)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(check_in_module, "time", types.SimpleNamespace(monotonic=lambda: c.now))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", "10")
    return c


def _alive(elapsed: float) -> int:  # beats every second
    return 1 + int(elapsed)


def test_the_last_rank_in_returns_at_once_and_releases_the_others(clock):
    first = FakeStore(clock)
    for me in (2, 1):  # ranks 2 and 1 arrived first (they are waiting)
        first.append("ckptlib/check_in/save/3/" + _tag([0, 1, 2]) + "/ranks", f"{me},")
        first.add("ckptlib/check_in/save/3/" + _tag([0, 1, 2]) + "/count", 1)
    check_in(first, "save", "save", 3, [0, 1, 2], BEAT)
    assert first.waits == 0 and clock.now == first.start
    assert first.data["ckptlib/check_in/save/3/" + _tag([0, 1, 2]) + "/all"] == b"1"  # the others may go


@pytest.mark.parametrize(("ranks", "grace"), [([0], "10"), ([0, 1], "0")], ids=["one-rank", "grace-0"])
def test_nothing_is_checked_for_one_rank_or_grace_0(clock, monkeypatch, ranks, grace):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", grace)
    store = FakeStore(clock)
    check_in(store, "load", "load", 0, ranks, BEAT)
    assert store.keys() == set() and store.waits == 0


@pytest.mark.parametrize("grace", [1, 2, 3, 5, 10])
def test_an_alive_rank_is_named_exactly_at_the_grace(clock, monkeypatch, grace):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", str(grace))
    store = FakeStore(clock, {1: _alive})
    with pytest.raises(NotCalledByEveryRankError) as info:
        check_in(store, "save", "save of step 4 to /c", 0, [0, 1], BEAT, path="/c")
    assert clock.now - store.start == grace  # not a second later
    assert str(info.value) == (
        "save of step 4 to /c on rank 0: it is a collective call, which every rank of its group must make, and "
        f"rank 1 (alive) did not make it within {grace} s (CKPTLIB_CALL_GRACE)"
    )
    assert info.value.ranks == [1] and info.value.rank == 0 and info.value.path == "/c"


def test_a_rank_that_never_beat_is_judged_at_the_grace_not_lost(clock):
    store = FakeStore(clock)  # rank 1's heartbeat never started: alive somewhere, not lost
    with pytest.raises(NotCalledByEveryRankError, match=r"rank 1 \(alive\) did not make it within 10 s"):
        check_in(store, "load", "load", 0, [0, 1], BEAT)
    assert clock.now - store.start == 10


def test_a_heartbeat_two_periods_late_is_alive(clock):
    store = FakeStore(clock, {1: lambda elapsed: 1 + int(elapsed) // 2})  # moves every 2 s of a 1 s period
    with pytest.raises(NotCalledByEveryRankError, match=r"rank 1 \(alive\)"):
        check_in(store, "load", "load", 0, [0, 1], BEAT)


def test_a_heartbeat_that_stopped_is_lost_after_three_periods_long_before_the_grace(clock, monkeypatch):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", "120")
    store = FakeStore(clock, {1: lambda elapsed: min(1 + int(elapsed), 6), 2: _alive})  # rank 1 stops at 5 s
    with pytest.raises(RankLostError) as info:
        check_in(store, "load", "load of /c", 0, [0, 1, 2], BEAT, path="/c", step=9)
    assert str(info.value) == (
        "load of /c on rank 0: rank 1 disappeared before making this collective call (its heartbeat stopped)"
    )
    assert (info.value.ranks, info.value.step, info.value.path, info.value.rank) == ([1], 9, "/c", 0)
    assert clock.now - store.start == 5 + 3  # seen moving at 5 s, then still for three beats


def test_the_first_max_looked_at_missing_ranks_heartbeats_are_read(clock, monkeypatch):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", "120")
    ranks = list(range(67))  # rank 0 calls; 66 missing
    stopped = {r: (lambda elapsed: 3) for r in (64, 66)}  # the 64th missing rank, and the 66th
    store = FakeStore(clock, {r: _alive for r in range(1, 67) if r not in stopped} | stopped)
    assert check_in_module.MAX_LOOKED_AT == 64
    with pytest.raises(RankLostError) as info:
        check_in(store, "save", "save", 0, ranks, BEAT)
    assert info.value.ranks == [64]  # rank 66 is past the first 64 missing ones: not read


def test_two_groups_of_one_size_do_not_share_a_check_in(clock, monkeypatch):
    store = FakeStore(clock, {2: _alive, 3: _alive})
    with pytest.raises(NotCalledByEveryRankError, match=r"rank 2 \(alive\)"):
        check_in(store, "save", "save", 0, [0, 2], BEAT)  # rank 0's call in group (0, 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(NotCalledByEveryRankError, match=r"rank 3 \(alive\)"):
        check_in(store, "save", "save", 0, [1, 3], BEAT)  # rank 1's in group (1, 3): not released by rank 0's


def _tag(ranks) -> str:
    import zlib

    return f"{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"
