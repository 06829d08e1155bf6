"""Every collective entry point of a CheckpointManager, plain and with the cluster tier, on 2
ranks (gloo): what must match across ranks is agreed before the first collective that depends
on it, and a rank that does not call, or calls after the others gave up on it, gets an error,
never a hang (issue: reliability round five, collectives).

The inventory (entry point -> arguments that must match; docs/manager.md "Collective calls"):

| entry point          | agreed                        | checked in as    |
|----------------------|-------------------------------|------------------|
| save                 | step, overwrite               | manager.save     |
| maybe_save           | step (in its decision round)  | (its save)       |
| load                 | step (None: the newest), require, fresh_start_ok | manager.load |
| latest               | (none)                        | manager.latest   |
| gc                   | dry_run                       | manager.gc       |
| break_lock           | (none)                        | manager.break_lock |
| wait, close, steps, local_steps, path, lock_holder, remote_lag, local_usage: no collective |

- (a) ranks passing different arguments: RanksDisagreeError on both ranks, the same text
  naming each rank's value, the root's files as before, and the group still in step (an agreed
  save and load afterwards work). Before: the cluster tier's `load(step=1)`/`load(step=2)`
  loaded step 1 on both, silently; `save(2)`/`save(3)` raised CheckpointExistsError on rank 0
  alone while rank 1 blocked; overwrite or `step=None` on one rank only ran different
  collectives on each (a hang, or garbage), `maybe_save` saved on one rank only, `gc(dry_run=)`
  took rank 0's word (plain) or removed on one node only (cluster).
- (b) a rank that never calls: NotCalledByEveryRankError on the caller within the check-in's
  grace, naming the rank; and the rank that then calls late gets NotCalledByEveryRankError at
  once (the check-in the others abandoned never completes for it), naming the ranks; both stay
  in step for the next call. Before: the latecomer completed the check-in alone and blocked in
  the call's collectives until the process group's timeout, then blamed a rank that is alive.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointManager, Cluster

TIERS = ("plain", "cluster")


def _state(step: int) -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4) + step, "step": step}


def _fresh() -> dict:
    return {"w": torch.zeros(3, 4), "step": -1}


def _root(base: str, tier: str) -> str:
    return os.path.join(base, f"node{dist.get_rank()}") if tier == "cluster" else os.path.join(base, "root")


def _manager(base: str, tier: str, **kwargs) -> CheckpointManager:
    return CheckpointManager(_root(base, tier), cluster=Cluster() if tier == "cluster" else None, **kwargs)


def _files(root: str) -> list[str]:
    out = []
    for here, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(here, n), root) for n in names if n != "ckptlib.lock"]
    return sorted(out)


def _outcome(action) -> tuple:
    try:
        action()
        return ("ok",)
    except ckptlib.CheckpointError as exc:
        return type(exc).__name__, str(exc), getattr(exc, "ranks", None), getattr(exc, "keys", None)


def _still_in_step(mgr: CheckpointManager) -> bool:
    """An agreed save and load after the refused call: the ranks make the same collectives."""
    mgr.save(7, _state(7))
    mgr.wait()
    fresh = _fresh()
    return mgr.load(fresh, step=7) == 7 and torch.equal(fresh["w"], _state(7)["w"]) and fresh["step"] == 7


# -- (a) different arguments --------------------------------------------------------------------
#: entry point -> (what rank `r` calls, the agreed argument named in the error, each rank's value)
CALLS = {
    "save-step": (lambda m, r: m.save(2 + r, _state(2)), "step", "save", "rank 0: 2; rank 1: 3"),
    "save-overwrite": (
        lambda m, r: m.save(2, _state(2), overwrite=r == 1),
        "overwrite",
        "save",
        "rank 0: False; rank 1: True",
    ),
    "maybe_save-step": (
        lambda m, r: m.maybe_save(2 + r, _state(2), force=True),
        "step",
        "maybe_save",
        "rank 0: 2; rank 1: 3",
    ),
    "load-step": (lambda m, r: m.load(_fresh(), step=1 + r), "step", "load", "rank 0: 1; rank 1: 2"),
    "load-newest-or-step": (
        lambda m, r: m.load(_fresh(), step=None if r == 0 else 1),
        "step",
        "load",
        "rank 0: no step; rank 1: 1",
    ),
    "load-require": (lambda m, r: m.load(_fresh(), require=r == 1), "require", "load", "rank 0: False; rank 1: True"),
    "load-fresh_start_ok": (
        lambda m, r: m.load(_fresh(), fresh_start_ok=r == 0),
        "fresh_start_ok",
        "load",
        "rank 0: True; rank 1: False",
    ),
    "gc-dry_run": (
        lambda m, r: m.gc(dry_run=r == 1),
        "dry_run",
        "gc",
        "rank 0: False; rank 1: True",
    ),
}


def _disagree(base: str, tier: str, entry: str) -> tuple:
    rank = dist.get_rank()
    mgr = _manager(base, tier)
    for step in (1, 2):
        mgr.save(step, _state(step))
    if entry.startswith("gc"):  # retention that would remove step 1
        mgr.close()
        mgr = _manager(base, tier, keep_last=1)
    dist.barrier()
    before = _files(_root(base, tier))
    call = CALLS[entry][0]
    outcome = _outcome(lambda: call(mgr, rank))
    dist.barrier()
    after = _files(_root(base, tier))
    unlocked = mgr.lock_holder() is None
    in_step = _still_in_step(mgr)
    mgr.close()
    return outcome, before == after, unlocked, in_step


def _every_entry(base: str, tier: str, worker: str, entries: list[str]) -> dict:
    """One launch of 2 ranks runs every entry point in turn, each in its own directory."""
    return {entry: globals()[worker](os.path.join(base, entry), tier, entry) for entry in entries}


_LAUNCHED: dict = {}  # (worker, tier) -> (base, every entry's per-rank results, or the launch's error)


def _results(tmp_path_factory, dist_run, worker: str, tier: str, entries, **kwargs) -> tuple[str, dict]:
    """Every entry's results of `worker` on `tier`, from one launch per module run (the cases
    of one tier share it: a launch per case would cost the suite minutes)."""
    key = (worker, tier)
    if key not in _LAUNCHED:
        base = str(tmp_path_factory.mktemp(f"{worker.strip('_')}-{tier}"))
        try:
            ranks = dist_run(2, _every_entry, base, tier, worker, list(entries), **kwargs)
            _LAUNCHED[key] = (base, {entry: [r[entry] for r in ranks] for entry in entries})
        except Exception as exc:  # noqa: BLE001 - every case of the tier reports it
            _LAUNCHED[key] = (base, exc)
    base, found = _LAUNCHED[key]
    if isinstance(found, Exception):
        raise found
    return base, found


CASES = [(tier, entry) for tier in TIERS for entry in CALLS]


@pytest.mark.parametrize("tier,entry", CASES, ids=[f"{tier}-{entry}" for tier, entry in CASES])
def test_ranks_passing_different_arguments_fail_alike(tmp_path_factory, dist_run, tier, entry):
    _call, name, what, shown = CALLS[entry]
    nodes = 2 if tier == "cluster" else 1
    _, every = _results(tmp_path_factory, dist_run, "_disagree", tier, CALLS, nodes=nodes, timeout=300)
    results = every[entry]
    (outcome0, *_), (outcome1, *_) = results
    assert outcome0 == outcome1, results  # the same error on every rank
    kind, text, ranks, keys = outcome0
    assert kind == "RanksDisagreeError", results
    assert text == (
        f"ranks disagree on the {name} of a collective {what}: {shown}. Every rank must pass the same {name}; "
        "nothing was written, read or removed"
    ), text
    assert ranks == [0, 1] and keys == [name], (ranks, keys)
    for _outcome_r, unchanged, unlocked, in_step in results:
        assert unchanged and unlocked and in_step, results


# -- (b) a rank that does not call, then calls late ---------------------------------------------
#: entry point -> (the call, how its NotCalledByEveryRankError names it)
ALONE = {
    "save": (lambda m: m.save(5, _state(5)), "save of step 5 to {root}"),
    "load": (lambda m: m.load(_fresh()), "load from {root}"),
    "load-step": (lambda m: m.load(_fresh(), step=1), "load from {root}"),
    "latest": (lambda m: m.latest(), "latest of {root}"),
    "gc": (lambda m: m.gc(), "gc of {root}"),
    "break_lock": (lambda m: m.break_lock(), "break_lock of {root}"),
}
GRACE = 3


def _alone_then_late(base: str, tier: str, entry: str) -> tuple:
    """Rank 0 calls alone and gives up; then rank 1 makes the same call, late."""
    from ckptlib._torch import c10d

    store = c10d.default_store()
    rank = dist.get_rank()
    mgr = _manager(base, tier)
    mgr.save(1, _state(1))
    call = ALONE[entry][0]
    if rank == 0:
        outcome = _outcome(lambda: call(mgr))
        store.set(f"test/rank0-gave-up/{entry}", "1")
    else:
        store.wait([f"test/rank0-gave-up/{entry}"])
        outcome = _outcome(lambda: call(mgr))
    in_step = _still_in_step(mgr)
    mgr.close()
    return outcome, in_step


ALONE_CASES = [(tier, entry) for tier in TIERS for entry in ALONE]


@pytest.mark.parametrize("tier,entry", ALONE_CASES, ids=[f"{tier}-{entry}" for tier, entry in ALONE_CASES])
def test_a_call_one_rank_skips_fails_there_and_for_the_latecomer(tmp_path_factory, dist_run, tier, entry):
    base, every = _results(
        tmp_path_factory,
        dist_run,
        "_alone_then_late",
        tier,
        ALONE,
        nodes=2 if tier == "cluster" else 1,
        pg_timeout=60,
        env={"CKPTLIB_CALL_GRACE": str(GRACE)},
        timeout=300,
    )
    results = every[entry]
    (first, in_step0), (late, in_step1) = results
    what0 = ALONE[entry][1].format(root=_root_of(os.path.join(base, entry), tier, 0))
    what1 = ALONE[entry][1].format(root=_root_of(os.path.join(base, entry), tier, 1))
    assert first == (
        "NotCalledByEveryRankError",
        f"{what0} on rank 0: it is a collective call, which every rank of its group must make, and rank 1 "
        f"(alive) did not make it within {GRACE} s (CKPTLIB_CALL_GRACE)",
        [1],
        [],
    ), results
    assert late == (
        "NotCalledByEveryRankError",
        f"{what1} on rank 1: it is a collective call, and rank 0 made it and gave up waiting for rank 1 after "
        f"{GRACE} s (CKPTLIB_CALL_GRACE): this call came too late and runs none of its collectives",
        [1],
        [],
    ), results
    assert in_step0 and in_step1, results


def _root_of(base: str, tier: str, rank: int) -> str:
    return os.path.join(base, f"node{rank}" if tier == "cluster" else "root")


def _maybe_save_alone(base: str) -> tuple:
    """maybe_save is not checked in (it runs every step): rank 0 alone meets the process
    group's timeout in its decision round, then the roll call names rank 1, alive."""
    from ckptlib._torch import c10d

    store = c10d.default_store()
    mgr = _manager(base, "plain")
    if dist.get_rank() == 0:
        outcome = _outcome(lambda: mgr.maybe_save(5, _state(5), force=True))
        store.set("test/rank0-done", "1")
        return outcome
    while not store.check(["test/rank0-done"]):  # alive, beating, never calling
        time.sleep(0.1)
    return ("waited",)


def test_a_maybe_save_one_rank_skips_is_an_error_at_the_process_groups_timeout(tmp_path, dist_run):
    results = dist_run(2, _maybe_save_alone, str(tmp_path), pg_timeout=5, timeout=150)
    assert results == [
        (
            "NotCalledByEveryRankError",
            "maybe_save's decision failed on rank 0: it is a collective call, which every rank must make, and rank 1 "
            "(alive) did not make it within the process group's timeout",
            [1],
            [],
        ),
        ("waited",),
    ], results
