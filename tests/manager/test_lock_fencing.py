"""Every irreversible step of a lock holder is fenced by its lease: a writer whose lease ran out
while it was paused (SIGSTOP: a long GC pause, a swapped-out host) and whose root another
writer took over meanwhile refuses its next irreversible step, on its rank, with a LockedError
naming the root, the new holder and the step; nothing the new holder committed is lost.

Before: a holder checked its lock only when a save or gc began. Writer A, stopped inside a save
after taking the lock, came back after writer B had taken the expired lease and committed, then
committed its own step, moved `latest` off B's step and let `keep_last=1` delete it.

Each case runs writer A in a subprocess with a 2 s lease; A stops itself (SIGSTOP, every
thread, its lease renewer too) at the point named, just before the irreversible step under
test; B (this process) waits for A's lease to expire, takes the root and commits step 200,
then A is continued and must refuse."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

from ckptlib import CheckpointManager
from ckptlib.errors import LockedError
from ckptlib.manager.lock import LEASE_PREFIX, LOCK_NAME, StaleLockWarning
from ckptlib.storage import open_storage

LEASE_S = 2.0

WRITER_A = r"""
import json, os, signal, sys, threading
import torch
import ckptlib.manager.cleanup as cleanup
from ckptlib import AsyncMode, CheckpointManager, Cluster
from ckptlib.format.write.transaction import SaveTransaction
from ckptlib.manager.cluster.node_save import NodeLocalSave
from ckptlib.manager.cluster.remote_tier import RemoteTier
from ckptlib.manager.single_root import SingleRoot

root, case = sys.argv[1], sys.argv[2]

def state(step, value=None):
    return {"w": torch.full((8,), float(step if value is None else value)), "step": step}

def stop():
    print("stopping", flush=True)
    # To this thread (the background one of an upload too): it stops before its next bytecode,
    # with every other thread of the process.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

def stop_before(owner, name):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        setattr(owner, name, real)  # once
        stop()
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)

def stop_after(owner, name):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        setattr(owner, name, real)
        result = real(*args, **kwargs)
        stop()
        return result
    setattr(owner, name, wrapper)

hold = case in ("close", "commit-held")
mode = {"latest-async": "thread"}.get(case)
cluster = Cluster() if case.startswith("node-") else None  # this node's root, its leader's lock
if case.startswith("remote-"):  # `root` is the remote root, the upload's lock
    cluster = Cluster(remote=RemoteTier(root, keep_last=1))
    mgr = CheckpointManager(root + "-node", hold_lock=hold, cluster=cluster)
else:
    keep = None if case == "gc" else 1
    async_save = AsyncMode(mode) if mode else False
    mgr = CheckpointManager(root, keep_last=keep, hold_lock=hold, cluster=cluster, async_save=async_save)
if case == "gc":
    CheckpointManager(root).save(100, state(100))
    CheckpointManager(root).save(300, state(300))
else:
    mgr.save(100, state(100))
    mgr.wait()
if case in ("commit", "commit-held"):
    stop_before(SaveTransaction, "commit")  # shards written, manifest not yet
    act = lambda: mgr.save(300, state(300))
elif case == "node-commit":
    stop_before(NodeLocalSave, "_commit_node")  # the leader's files written, its manifest not yet
    act = lambda: mgr.save(300, state(300))
elif case == "remote-commit":
    stop_before(RemoteTier, "_commit")  # every file uploaded, the remote manifest not written yet
    act = lambda: (mgr.save(300, state(300)), mgr.wait())
elif case == "remote-retention":
    stop_after(cleanup, "to_delete")  # the remote `latest` moved to 300; step 100 chosen for deletion
    act = lambda: (mgr.save(300, state(300)), mgr.wait())
elif case in ("latest", "latest-async"):
    stop_before(SingleRoot, "_publish")  # step 300 committed, `latest` not moved yet (async: the background's)
    act = lambda: (mgr.save(300, state(300)), mgr.wait())
elif case in ("retention", "node-retention"):
    stop_after(cleanup, "to_delete")  # `latest` moved to 300; step 100 chosen for deletion
    act = lambda: mgr.save(300, state(300))
elif case == "gc":
    from ckptlib.manager.policies import KeepLast
    gc_mgr = CheckpointManager(root, keep_last=1)
    stop_after(cleanup, "to_delete")  # step 100 chosen for deletion
    act = lambda: gc_mgr.gc()
elif case == "overwrite":
    stop_before(SaveTransaction, "prepare")  # before step 100's files are removed
    act = lambda: mgr.save(100, state(100, 101.0), overwrite=True)
elif case == "close":
    stop()  # between saves, holding the lock
    act = mgr.close
try:
    act()
    print(json.dumps({"raised": None}), flush=True)
except Exception as exc:
    outcome = {"raised": type(exc).__name__, "message": str(exc), "path": getattr(exc, "path", None)}
    print(json.dumps(outcome), flush=True)
"""

# What A's continued run must refuse, as its LockedError says it.
REFUSED = {
    "commit": "commit step 300",
    "commit-held": "commit step 300",
    "node-commit": "commit step 300",
    "remote-commit": "commit step 300",
    "latest": "move latest to step 300",
    "latest-async": "move latest to step 300",
    "retention": "remove step_0000000100",
    "node-retention": "remove step_0000000100",
    "remote-retention": "remove step_0000000100",
    "gc": "remove step_0000000100",
    "overwrite": "overwrite step 100",
    "close": "release the lock",
}
# The step directories afterwards: B's step 200 and everything A committed before it lost the root.
STEPS_AFTER = {
    "commit": [100, 200],
    "commit-held": [100, 200],
    "node-commit": [100, 200],
    "remote-commit": [100, 200],
    "latest": [100, 200, 300],
    "latest-async": [100, 200, 300],
    "retention": [100, 200, 300],
    "node-retention": [100, 200, 300],
    "remote-retention": [100, 200, 300],
    "gc": [100, 200, 300],
    "overwrite": [100, 200],
    "close": [100, 200],
}


def _state(step: int, value: float | None = None) -> dict:
    return {"w": torch.full((8,), float(step if value is None else value)), "step": step}


def _steps(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())


def _wait_stopped(proc: subprocess.Popen) -> None:
    """Until A stopped itself (it prints "stopping" first); fails if it ended instead."""
    line = proc.stdout.readline()
    assert line.strip() == "stopping", (line, proc.stderr.read() if proc.poll() is not None else "")
    while True:
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)


def _take_over(mgr_b: CheckpointManager, step: int, state: dict, *, overwrite: bool = False) -> str:
    """B saves `step` once A's lease expired (LockedError until then); returns the warning."""
    deadline = time.monotonic() + 120
    while True:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", StaleLockWarning)
            try:
                mgr_b.save(step, state, overwrite=overwrite)
            except LockedError:
                assert time.monotonic() < deadline, "A's lease never expired"
                time.sleep(0.1)
                continue
        stale = [str(w.message) for w in seen if issubclass(w.category, StaleLockWarning)]
        assert len(stale) == 1, stale
        return stale[0]


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_paused_holder_refuses_its_next_irreversible_step_after_losing_the_lease(tmp_path, monkeypatch, case):
    root = str(tmp_path / "run")
    env = dict(os.environ, CKPTLIB_LOCK_LEASE_S=str(LEASE_S))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_A, root, case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        _wait_stopped(proc)
        a_pid = proc.pid
        mgr_b = CheckpointManager(root, hold_lock=True)  # B keeps the lock while A is continued
        if case == "overwrite":  # B replaces the step A is about to overwrite, then saves 200
            warning = _take_over(mgr_b, 100, _state(100, 1000.0), overwrite=True)
        else:
            warning = _take_over(mgr_b, 200, _state(200))
        assert f"removing a stale lock left by pid {a_pid} on host " in warning
        assert f"(its {LEASE_S:.0f} s lease expired: last " in warning
        if case == "overwrite":
            mgr_b.save(200, _state(200))
        b_lock = open_storage(root).read(LOCK_NAME)
        b_holder = mgr_b.lock_holder()
        os.kill(a_pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome == {
        "raised": "LockedError",
        "message": f"{root}: this manager's lock ({root}/{LOCK_NAME}) was removed while it held it; "
        f"pid {os.getpid()} on host {socket.gethostname()}, since {b_holder.created} holds it now. "
        "Another writer may have written this root; "
        f"refusing to {REFUSED[case]}.",
        "path": root,
    }, err
    # B's lock is untouched (A never released or renewed it), and so is everything B committed.
    assert open_storage(root).read(LOCK_NAME) == b_lock
    assert not [n for n in os.listdir(root) if n.startswith(LEASE_PREFIX) and b_holder.token not in n]
    assert _steps(root) == STEPS_AFTER[case]
    assert os.readlink(os.path.join(root, "latest")) == "step_0000000200"
    assert mgr_b.steps() == STEPS_AFTER[case]
    for step, value in [(200, 200.0), (100, 1000.0 if case == "overwrite" else 100.0)]:
        into = _state(0, 0.0)
        assert mgr_b.load(into, step) == step
        assert torch.equal(into["w"], torch.full((8,), value)), (step, into["w"])
    mgr_b.close()
    assert sorted(n for n in os.listdir(root) if not n.startswith("step_")) == ["latest"]


def test_a_paused_holder_whose_lease_nobody_took_goes_on(tmp_path, monkeypatch):
    """A lease that ran out while nobody took the root over is not lost: the holder renews it
    before its next irreversible step and goes on (compare-and-act on the lock file)."""
    monkeypatch.setenv("CKPTLIB_LOCK_LEASE_S", "1")
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1, hold_lock=True)
    mgr.save(1, _state(1))
    lock = mgr.tier.lock
    lock._stop_renewing()  # as if paused: no renewal while the lease runs out
    time.sleep(1.5)
    resumed = time.time()
    mgr.save(2, _state(2))
    assert _steps(root) == [2] and mgr.latest() == 2
    assert float(open_storage(root).read(LEASE_PREFIX + lock.token).decode()) >= resumed  # renewed, then committed
    mgr.close()
    assert sorted(os.listdir(root)) == ["latest", "step_0000000002"]


def _paused_rank(root: str, case: str, pidfile: str) -> tuple | None:
    """A rank of a 2-rank writer A: rank 0 (the lock holder) stops itself just before the
    irreversible step `case`; rank 1 waits for it in the save's collective. Returns what the
    save of step 300 raised on this rank."""
    import threading

    import torch.distributed as dist

    from ckptlib.errors import CheckpointError
    from ckptlib.format.write.transaction import SaveTransaction
    from ckptlib.manager.single_root import SingleRoot

    os.environ["CKPTLIB_LOCK_LEASE_S"] = str(LEASE_S)
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(100, _state(100))
    if dist.get_rank() == 0:
        owner, name = {"commit": (SaveTransaction, "commit"), "latest": (SingleRoot, "_publish")}[case]
        real = getattr(owner, name)

        def stop_first(*args, **kwargs):
            setattr(owner, name, real)
            with open(pidfile, "w") as f:
                f.write(str(os.getpid()))
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            return real(*args, **kwargs)

        setattr(owner, name, stop_first)
    try:
        mgr.save(300, _state(300))
    except CheckpointError as exc:
        return type(exc).__name__, str(exc), exc.path
    return None


@pytest.mark.parametrize("case", ["commit", "latest"])
def test_every_rank_of_a_paused_writer_raises_the_lost_lock(tmp_path, dist_run, case):
    """The fence runs on rank 0, which holds the lock; its LockedError reaches every rank of the
    save (through DCP's final round for the commit, rank 0's decision for `latest`)."""
    import threading

    root, pidfile = str(tmp_path / "run"), str(tmp_path / "a.pid")
    results: list = []
    ranks = threading.Thread(target=lambda: results.append(dist_run(2, _paused_rank, root, case, pidfile)))
    ranks.start()
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(pidfile) and open(pidfile).read()):
            assert ranks.is_alive() and time.monotonic() < deadline, "rank 0 never stopped"
            time.sleep(0.05)
        a_pid = int(open(pidfile).read())
        while open(f"/proc/{a_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.02)
        mgr_b = CheckpointManager(root, hold_lock=True)
        warning = _take_over(mgr_b, 200, _state(200))
        assert f"removing a stale lock left by pid {a_pid} on host " in warning
        b_holder = mgr_b.lock_holder()
    finally:
        if os.path.exists(pidfile) and open(pidfile).read():
            os.kill(int(open(pidfile).read()), signal.SIGCONT)
        ranks.join(300)
    what = {"commit": "commit step 300", "latest": "move latest to step 300"}[case]
    message = (
        f"{root}: this manager's lock ({root}/{LOCK_NAME}) was removed while it held it; "
        f"pid {os.getpid()} on host {socket.gethostname()}, since {b_holder.created} holds it now. "
        f"Another writer may have written this root; refusing to {what}."
    )
    assert results == [[("LockedError", message, root)] * 2]
    assert _steps(root) == ([100, 200] if case == "commit" else [100, 200, 300])
    assert os.readlink(os.path.join(root, "latest")) == "step_0000000200"
    mgr_b.close()
