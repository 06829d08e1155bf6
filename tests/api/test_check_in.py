"""A collective call some ranks never make fails in seconds on the ranks that made it
(issue 37, item 4: `ckptlib._runtime.check_in`), naming the ranks that did not and saying the
call is collective; a rank that died before the call is named as lost; ranks that all call
pass, and a call inside another one is not checked twice. A rank making the call after the
others gave up on it raises at once (the check-in is one generation), never completing it
alone and blocking in the call's collectives."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import NotCalledByEveryRankError, RankLostError
from ckptlib._runtime import check_in as check_in_module
from ckptlib._runtime.check_in import check_in, grace_seconds

BEAT = ("test/heartbeat", 1.0)


@pytest.fixture
def as_rank_0(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", "2")
    monkeypatch.setattr(check_in_module, "LIVENESS_AFTER_SECONDS", 0.5)
    return dist.HashStore()


def test_every_rank_calling_passes(as_rank_0):
    store = as_rank_0
    base = f"ckptlib/check_in/op/0/{_tag([0, 1])}"

    def rank_1_arrives():  # as check_in on rank 1 would, the last one in
        time.sleep(0.5)
        store.append(f"{base}/ranks", "1,")
        store.add(f"{base}/count", 1)
        store.set(f"{base}/all", "1")

    late = threading.Thread(target=rank_1_arrives)
    late.start()
    check_in(store, "op", "op", 0, [0, 1], BEAT)  # returns once rank 1 checked in
    late.join()
    assert store.get(f"{base}/ranks") == b"0,1," and store.add(f"{base}/count", 0) == 2


def _tag(ranks) -> str:
    import zlib

    return f"{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"


def test_an_alive_rank_that_never_calls_is_named(as_rank_0):
    store = as_rank_0
    stop = threading.Event()

    def beating():  # rank 1 trains on: its heartbeat moves
        while not stop.is_set():
            store.add(f"{BEAT[0]}/1", 1)
            time.sleep(0.2)

    thread = threading.Thread(target=beating)
    thread.start()
    try:
        with pytest.raises(NotCalledByEveryRankError) as info:
            check_in(store, "save", "save of step 3 to /ckpt", 0, [0, 1, 2], BEAT, path="/ckpt")
    finally:
        stop.set()
        thread.join()
    assert str(info.value) == (
        "save of step 3 to /ckpt on rank 0: it is a collective call, which every rank of its group must make, and "
        "ranks 1, 2 (alive) did not make it within 2 s (CKPTLIB_CALL_GRACE)"
    )
    assert info.value.ranks == [1, 2] and info.value.path == "/ckpt"


def test_a_rank_whose_heartbeat_stopped_is_lost(as_rank_0, monkeypatch):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", "120")  # found by its heartbeat, long before the grace
    store = as_rank_0
    store.add(f"{BEAT[0]}/1", 7)  # it beat, then died
    with pytest.raises(RankLostError, match=re.escape("load of /ckpt on rank 0: rank 1 disappeared before making")):
        check_in(store, "load", "load of /ckpt", 0, [0, 1], BEAT)


@pytest.mark.parametrize(("text", "value"), [("", 60.0), ("5", 5.0), ("0", 0.0), ("-3", 0.0), ("soon", 60.0)])
def test_the_grace_comes_from_the_environment(monkeypatch, text, value):
    monkeypatch.setenv("CKPTLIB_CALL_GRACE", text)
    assert grace_seconds() == value


def _calls(path: str, who: str) -> dict:
    """Rank 0 or 1 alone makes a call; the other waits (alive) until it returns, then makes it late."""
    from ckptlib._torch import c10d

    store = c10d.default_store()
    rank = dist.get_rank()
    caller = 0 if who != "load-on-1" else 1

    def call() -> dict:
        try:
            if who == "save":
                ckptlib.save(path, {"w": torch.ones(4)})
            elif who == "async":
                ckptlib.async_save(path, {"w": torch.ones(4)}).result()
            else:
                ckptlib.load(path, {"w": torch.zeros(4)})
        except ckptlib.CheckpointError as exc:
            return {"type": type(exc).__name__, "message": str(exc), "ranks": list(exc.ranks)}
        return {"type": None}

    if rank == caller:
        try:
            return call()
        finally:
            store.set("test/caller-done", "1")
    while not store.check(["test/caller-done"]):
        time.sleep(0.1)
    return call()  # late: the caller gave up on this call; it must not run its collectives alone


@pytest.mark.parametrize("who", ["save", "async", "load-on-1"])
def test_a_call_made_by_one_rank_fails_there_in_seconds(tmp_path, dist_run, who):
    path = str(tmp_path / "c")
    if who == "load-on-1":
        ckptlib.save(path, {"w": torch.ones(4)})
    results = dist_run(2, _calls, path, who, pg_timeout=600, env={"CKPTLIB_CALL_GRACE": "3"}, timeout=120)
    caller, other = (0, 1) if who != "load-on-1" else (1, 0)
    got = results[caller]
    what = f"load of {path}" if who == "load-on-1" else f"save to {path}"
    assert got == {
        "type": "NotCalledByEveryRankError",
        "message": f"{what} on rank {caller}: it is a collective call, which every rank of its group must make, "
        f"and rank {other} (alive) did not make it within 3 s (CKPTLIB_CALL_GRACE)",
        "ranks": [other],
    }
    late = f"load of {path}" if who == "load-on-1" else f"save to {path}"
    assert results[other] == {
        "type": "NotCalledByEveryRankError",
        "message": f"{late} on rank {other}: it is a collective call, and rank {caller} made it and gave up waiting "
        f"for rank {other} after 3 s (CKPTLIB_CALL_GRACE): this call came too late and runs none of its collectives",
        "ranks": [other],
    }


def _load_own_copy(base: str) -> bool:
    state = {"w": torch.zeros(4)}
    ckptlib.load(f"{base}{dist.get_rank()}", state)  # each rank its own node's copy
    return torch.equal(state["w"], torch.ones(4))


def test_ranks_loading_their_own_paths_make_the_same_call(tmp_path, dist_run):
    """The check-in is keyed by the kind of call, not its path: ranks that each load their own
    node's copy (the cluster tier's node-local roots) are one call."""
    import shutil

    ckptlib.save(str(tmp_path / "c"), {"w": torch.ones(4)})
    for rank in range(2):
        shutil.copytree(tmp_path / "c", tmp_path / f"c{rank}")
    assert dist_run(2, _load_own_copy, str(tmp_path / "c"), env={"CKPTLIB_CALL_GRACE": "3"}, timeout=120) == [True] * 2


def test_a_rank_that_comes_after_the_others_gave_up_raises_at_once(as_rank_0, monkeypatch):
    """The check-in is one generation: rank 0 gave up on it; rank 1, coming later, must not
    complete it alone (and walk into the call's collectives by itself)."""
    store = as_rank_0
    store.add(f"{BEAT[0]}/1", 1)  # rank 1 is alive (it beats once; it is judged at the grace)
    with pytest.raises(NotCalledByEveryRankError):
        check_in(store, "save", "save of step 3 to /ckpt", 0, [0, 1], BEAT, path="/ckpt")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(NotCalledByEveryRankError) as info:
        check_in(store, "save", "save of step 3 to /ckpt", 0, [0, 1], BEAT, path="/ckpt/step_3")
    assert str(info.value) == (
        "save of step 3 to /ckpt on rank 1: it is a collective call, and rank 0 made it and gave up waiting for "
        "rank 1 after 2 s (CKPTLIB_CALL_GRACE): this call came too late and runs none of its collectives"
    )
    assert info.value.ranks == [1] and info.value.path == "/ckpt/step_3" and info.value.rank == 1
    base = f"ckptlib/check_in/save/0/{_tag([0, 1])}"
    assert not store.check([f"{base}/all"])  # never completed
    # the next call pairs up again: both ranks at serial 1
    store.append(f"ckptlib/check_in/save/1/{_tag([0, 1])}/ranks", "0,")
    store.add(f"ckptlib/check_in/save/1/{_tag([0, 1])}/count", 1)
    check_in(store, "save", "save of step 4 to /ckpt", 1, [0, 1], BEAT)  # rank 1, the last one in


@pytest.mark.parametrize(("arrived", "abandoned"), [(1, True), (2, False)], ids=["still-missing", "all-came"])
def test_giving_up_races_the_last_rank_in_one_atomic_step(arrived, abandoned):
    """A rank giving up learns, in the same increment, whether the last rank came meanwhile:
    then the call goes on (on every rank); else every later arrival sees the mark."""
    store = dist.HashStore()
    store.add("base/count", arrived)
    assert check_in_module._give_up(store, "base", 0, [1], 2.0, 2) is abandoned
    assert store.get("base/abandoned") == b"0:1:2;"
    assert (store.add("base/count", 1) >= check_in_module.ABANDONED) is True
