"""The check-in's decisions (`ckptlib._runtime.check_in`) on a store and a clock the test
drives, single process: the last rank in never waits, a one-rank group touches nothing, ranks
that come together cost two store operations each, the grace is exact, a rank that came in the
last seconds is not named, what a check-in costs does not grow with the group, and two groups
of one size never share a check-in. The gloo runs are in tests/api/test_check_in.py."""

from __future__ import annotations

import types
from typing import Callable

import pytest
import torch.distributed as dist

from ckptlib import NotCalledByEveryRankError
from ckptlib._runtime import check_in as check_in_module
from ckptlib._runtime.check_in import ABANDONED, check_in


class Clock:
    def __init__(self) -> None:
        self.now = 500.0


class FakeStore:
    """The store calls check_in makes, logged by kind; `wait` finds what is set or moves the
    clock to the next event (`events`: (seconds into the call, what the other ranks do)) or by
    its timeout."""

    def __init__(self, clock: Clock, events: list[tuple[float, Callable[["FakeStore"], None]]] = ()):
        self.clock, self.start = clock, clock.now
        self.events = sorted(events, key=lambda e: e[0])
        self.data: dict[str, bytes] = {}
        self.counts: dict[str, int] = {}
        self.ops: list[str] = []

    def append(self, key: str, value: str) -> None:
        self.ops.append("append")
        self.data[key] = self.data.get(key, b"") + value.encode()

    def add(self, key: str, amount: int) -> int:
        self.ops.append("add")
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.ops.append("set")
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self.ops.append("get")
        return self.data[key]

    def wait(self, keys, timeout) -> None:
        self.ops.append("wait")
        until = self.clock.now + timeout.total_seconds()
        while True:
            if all(k in self.data for k in keys):
                return
            if self.events and self.start + self.events[0][0] <= until:
                at, event = self.events.pop(0)
                self.clock.now = max(self.clock.now, self.start + at)
                event(self)
                continue
            self.clock.now = until
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


def _base(ranks, call="save", serial=0) -> str:
    return check_in_module.base_key(call, serial, ranks)


def test_the_last_rank_in_returns_at_once_and_releases_the_others(clock):
    first = FakeStore(clock)
    first.counts[_base([0, 1, 2], serial=3) + "/count"] = 2  # ranks 2 and 1 arrived first (they are waiting)
    check_in(first, "save", "save", 3, [0, 1, 2])
    assert first.ops == ["add", "set"] and clock.now == first.start
    assert first.data[_base([0, 1, 2], serial=3) + "/all"] == b"1"  # the others may go


@pytest.mark.parametrize("size", [2, 3, 67])
def test_a_rank_the_last_one_releases_costs_one_increment_and_one_wait(clock, size):
    ranks = list(range(size))
    store = FakeStore(clock, [(2.5, lambda s: s.set(_base(ranks) + "/all", "1"))])
    check_in(store, "save", "save", 0, ranks)
    assert store.ops == ["add", "wait", "set"]  # the set is the last rank's (the event), not this one's
    assert clock.now - store.start == 2.5


@pytest.mark.parametrize(("ranks", "grace"), [([0], "10"), ([0, 1], "0")], ids=["one-rank", "grace-0"])
def test_nothing_is_checked_for_one_rank_or_grace_0(clock, monkeypatch, ranks, grace):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", grace)
    store = FakeStore(clock)
    check_in(store, "load", "load", 0, ranks)
    assert store.keys() == set() and store.ops == []


@pytest.mark.parametrize("grace", [1, 2, 3, 5, 10])
def test_a_missing_rank_is_named_exactly_at_the_grace(clock, monkeypatch, grace):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", str(grace))
    store = FakeStore(clock)
    with pytest.raises(NotCalledByEveryRankError) as info:
        check_in(store, "save", "save of step 4 to /c", 0, [0, 1], path="/c")
    assert clock.now - store.start == grace  # not a second later
    assert str(info.value) == (
        "save of step 4 to /c on rank 0: it is a collective call, which every rank of its group must make, and "
        f"rank 1 did not make it within {grace} s (CKPTLIB_CALL_GRACE)"
    )
    assert info.value.ranks == [1] and info.value.rank == 0 and info.value.path == "/c"
    assert store.data[_base([0, 1]) + "/abandoned"] == f"0:1:{grace};".encode()
    assert store.counts[_base([0, 1]) + "/count"] == 1 + ABANDONED


@pytest.mark.parametrize("size", [2, 3, 67])
def test_giving_up_costs_the_same_whatever_the_group_size(clock, size):
    """Waiting is blocking waits, never a poll: the list is appended to once and read once."""
    store = FakeStore(clock)
    with pytest.raises(NotCalledByEveryRankError) as info:
        check_in(store, "save", "save", 0, list(range(size)))
    assert info.value.ranks == list(range(1, size))
    assert store.ops == ["add", "wait", "append", "wait", "get", "add", "append", "add"]


def test_a_rank_that_came_in_the_last_seconds_is_waited_for_not_named(clock):
    """Rank 2 came a second before the grace (counted, not yet on the list: it appends after its
    own first seconds of waiting); rank 0 waits for it to list itself and names only rank 1."""
    ranks = [0, 1, 2]
    base = _base(ranks)
    store = FakeStore(
        clock,
        [(9.0, lambda s: s.add(base + "/count", 1)), (12.0, lambda s: s.append(base + "/ranks", "2,"))],
    )
    with pytest.raises(NotCalledByEveryRankError) as info:
        check_in(store, "save", "save", 0, ranks)
    assert info.value.ranks == [1]
    assert clock.now - store.start == 10 + check_in_module.LIVENESS_AFTER_SECONDS + 1


def test_a_rank_that_came_last_in_the_last_seconds_lets_the_call_go_on(clock):
    base = _base([0, 1])
    store = FakeStore(clock, [(9.5, lambda s: (s.add(base + "/count", 1), s.set(base + "/all", "1")))])
    check_in(store, "save", "save", 0, [0, 1])  # no error: rank 1 came, last, before the grace
    assert clock.now - store.start == 9.5


def test_two_groups_of_one_size_do_not_share_a_check_in(clock, monkeypatch):
    store = FakeStore(clock)
    with pytest.raises(NotCalledByEveryRankError, match=r"rank 2 did not make it"):
        check_in(store, "save", "save", 0, [0, 2])  # rank 0's call in group (0, 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(NotCalledByEveryRankError, match=r"rank 3 did not make it"):
        check_in(store, "save", "save", 0, [1, 3])  # rank 1's in group (1, 3): not released by rank 0's
