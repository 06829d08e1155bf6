"""What ckptlib's calls cost the job's shared machinery, at 2 and 4 real gloo ranks (issue 47,
item 1): no process group made by a save or a load (an async save makes one, lazily connected,
once per group and world), the same number of rendezvous-store operations per rank and call at
every world size (at most four: the check-in's increment and wait, the call's watch and its end),
an exit barrier of at most four, a roll call of at most six, and no ckptlib thread alive between
calls. Counted with `ckptlib.testing.harness.store_counts`."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib.testing.harness.store_counts import counting


def _state(step: int) -> dict:
    return {"w": torch.full((8, 4), float(step)), "step": step}


def _calls(base: str) -> dict:
    """Every public call once after a first of its kind (what a job pays per call from then on),
    each with its store operations, groups made and the ckptlib threads alive after it."""
    costs: dict[str, tuple[int, int, list[str]]] = {}
    with counting() as counts:

        def measure(name: str, fn) -> None:
            mark = counts.mark()
            fn()
            costs[name] = (*counts.since(mark), counts.new_threads())

        def loaded(path: str, step: int, **kwargs) -> None:
            state = _state(0)
            ckptlib.load(path, state, **kwargs)
            assert torch.equal(state["w"], _state(step)["w"]) and state["step"] == step

        measure("save (first)", lambda: ckptlib.save(os.path.join(base, "a"), _state(1), step=1))
        measure("save", lambda: ckptlib.save(os.path.join(base, "b"), _state(2), step=2))
        measure("load (first)", lambda: loaded(os.path.join(base, "a"), 1))
        measure("load", lambda: loaded(os.path.join(base, "b"), 2))
        measure("load read_once", lambda: loaded(os.path.join(base, "b"), 2, read_once=True))
        measure("load read_once=False", lambda: loaded(os.path.join(base, "b"), 2, read_once=False))
        mgr = ckptlib.CheckpointManager(os.path.join(base, "run"))
        measure("manager.save", lambda: mgr.save(1, _state(1)))
        measure("manager.maybe_save (no save)", lambda: mgr.maybe_save(2, _state(2)))
        measure("manager.load", lambda: loaded_by(mgr, 1))
        mgr.close()
        first = os.path.join(base, "c")
        measure("async_save (first)", lambda: ckptlib.async_save(first, _state(3), step=3, async_mode="thread"))
        measure("async_save wait", lambda: async_wait(first))
        second = os.path.join(base, "d")
        measure("async_save", lambda: ckptlib.async_save(second, _state(4), step=4, async_mode="thread").wait())
        measure("exit_barrier", ckptlib.exit_barrier)
    return {name: (ops, groups, threads) for name, (ops, groups, threads) in costs.items()}


def async_wait(path: str) -> None:
    from ckptlib.saving import background_save

    for handle in list(background_save._all):
        if handle.uri == path:
            handle.wait(timeout=120)


def loaded_by(mgr, step: int) -> None:
    state = _state(0)
    assert mgr.load(state) == step and torch.equal(state["w"], _state(step)["w"])


SYNC = ["save (first)", "save", "load (first)", "load", "load read_once", "load read_once=False", "manager.save",
        "manager.maybe_save (no save)", "manager.load"]  # fmt: skip


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_every_call_costs_the_store_alike_at_every_world_size_and_makes_no_group(tmp_path, dist_run, world):
    results = dist_run(world, _calls, str(tmp_path), timeout=240)
    for rank, costs in enumerate(results):
        ops = {name: cost[0] for name, cost in costs.items()}
        groups = {name: cost[1] for name, cost in costs.items()}
        # per rank and call: the check-in's increment and wait (or the last one's set), the call's
        # watch and its end; maybe_save's decision touches the store only when a collective breaks
        assert {name: ops[name] for name in SYNC} == {
            **{name: 4 for name in SYNC},
            "manager.maybe_save (no save)": 0,
        }, (rank, costs)
        assert ops["async_save (first)"] + ops["async_save wait"] == 4 and ops["async_save"] == 4, (rank, costs)
        # the exit barrier: in (increment, wait) and out (increment; rank 0 waits for the last one out,
        # who sets the key it waits on)
        assert ops["exit_barrier"] == 4 if rank == 0 else ops["exit_barrier"] in (3, 4), (rank, costs)
        assert groups == {name: 1 if name == "async_save (first)" else 0 for name in costs}, (rank, costs)
        # no thread of ckptlib's between calls, but while an async save runs in the background
        assert {name: cost[2] for name, cost in costs.items() if name in SYNC} == {name: [] for name in SYNC}
    # one set by the last one out (rank 0's fourth when it is last; else it waits, and another sets)
    assert sum(result["exit_barrier"][0] for result in results) - 3 * world in (1, 2), results


def _roll_call(victim: int) -> dict:
    """Every rank in one call; rank `victim` stays blocked (its watch answers for it), the
    others hold a roll call: nobody is absent, at a cost per rank that does not grow."""
    from ckptlib._runtime import agree, roll_call
    from ckptlib._torch import c10d

    with counting() as counts:
        with agree.called_by_every_rank("test", "a test call"):
            call = agree._depth.call
            if dist.get_rank() == victim:
                c10d.default_store().wait(["test/rolled"])  # blocked, as in a collective
                found = None
            else:
                found = roll_call.roll_call(call, 30.0, broke=True)
                if dist.get_rank() == 0 and found[0] == []:  # every rank answered: the victim may go on
                    c10d.default_store().set("test/rolled", "1")
        # less the call's own four (check-in, watch) and the test's own wait or set
        during = counts.store_ops - 4 - (1 if dist.get_rank() in (0, victim) else 0)
    return {"found": found, "during": during}


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_a_roll_call_is_answered_by_a_blocked_ranks_watch_at_a_cost_that_does_not_grow(dist_run, world):
    results = dist_run(world, _roll_call, 1, timeout=120)
    assert [r["found"] for r in results] == [([], True) if rank != 1 else None for rank in range(world)]
    # a survivor: open (increment), append, increment, wait: four; the first one in also wakes the
    # watches (one multi_set) and the last answer sets the key the others wait on
    survivors = [r["during"] for rank, r in enumerate(results) if rank != 1]
    assert all(4 <= n <= 6 for n in survivors), results
    # the blocked rank: its watch's answer (append, increment, and the set when it was the last)
    assert results[1]["during"] in (2, 3), results
    assert sum(survivors) + results[1]["during"] == 4 * world, results
