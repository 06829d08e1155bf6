"""A lock holder paused while it writes a step's files never writes into the step another
writer committed there meanwhile: every file of a save (each rank's shard, `.metadata`, the
manifest) is created, never written over one already there, so the resumed writer's next
file is a StorageError naming it and the other writer's step stays byte for byte as it was.

Before: writer A, stopped inside save(300) while writing its files (a long GC pause, a
swapped-out host), came back after writer B had taken the expired lease and committed its own
step 300 in the same directory; A's next file was opened with truncation (or its manifest
renamed over B's), so B's committed step 300 then failed its checksums (found by the fault
model, tests/helpers/fault_root.py `paused_mid_save` with the same step saved by both jobs).
The lease fences A's next irreversible step (tests/manager/test_lock_fencing.py), but the
shards and `.metadata` come before the commit's fence, and the manifest right after it.

Each case runs writer A in a subprocess with a 2 s lease; it stops itself (SIGSTOP, every
thread) at the point named; B (this process) takes the root once A's lease ran out and saves
step 300 with other values; then A is continued and must fail naming B's file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from helpers.paused_writer import state as _state
from helpers.paused_writer import step_numbers as _steps
from helpers.paused_writer import take_over as _take_over
from helpers.paused_writer import wait_stopped as _wait_stopped

from ckptlib import CheckpointManager
from ckptlib.manager.lock import LOCK_NAME
from ckptlib.storage import open_storage

LEASE_S = 2.0

WRITER_A = r"""
import json, os, signal, sys, threading
import torch
from ckptlib import AsyncMode, CheckpointManager, Cluster
from ckptlib.format.write.dcp_writer import CkptWriter
from ckptlib.format.write.transaction import SaveTransaction
from ckptlib.manager.lock import RootLock
from ckptlib.saving.writer_process import WriterProcess
from ckptlib.storage.local import LocalStorage

root, case = sys.argv[1], sys.argv[2]

def state(step):
    return {"w": torch.full((8,), float(step)), "step": step}

def stop():
    print("stopping", flush=True)
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

def stop_before(owner, name):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        setattr(owner, name, real)  # once
        stop()
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)

def stop_after_fence(what):
    real = RootLock.fence
    def fence(self, act):
        real(self, act)
        if act == what:  # the lease check just passed: paused before the act it guards
            RootLock.fence = real
            stop()
    RootLock.fence = fence

def stop_after_uncommitting(step_dir):
    real = LocalStorage.delete
    def delete(self, paths):
        paths = list(paths)
        real(self, paths)
        if self.uri.endswith(step_dir) and paths == ["ckptlib.json"]:  # uncommitted, its files not removed yet
            LocalStorage.delete = real
            stop()
    LocalStorage.delete = delete

mode = {"shard-thread": "thread", "shard-process": "process"}.get(case)
cluster = Cluster() if case.startswith("node-") else None  # this node's root, its leader's lock
keep = 1 if case == "retention" else None
mgr = CheckpointManager(
    root, keep_last=keep, hold_lock=False, cluster=cluster, async_save=AsyncMode(mode) if mode else False
)
mgr.save(100, state(100))
mgr.wait()
act = lambda: mgr.save(300, state(300))
if case in ("shard", "shard-thread", "node-shard"):
    stop_before(SaveTransaction, "open_shard")  # the step prepared, its shard not opened yet
elif case == "shard-process":
    stop_before(WriterProcess, "write_shard")  # the writer process not asked yet
elif case == "metadata":
    stop_before(CkptWriter, "finish")  # the shard written, `.metadata` not yet
elif case in ("manifest", "node-manifest"):
    stop_after_fence("commit step 300")  # the commit's lease check passed, the manifest not written
elif case in ("overwrite", "node-overwrite"):
    stop_after_uncommitting("step_0000000100")  # its manifest removed, its files not yet
    act = lambda: mgr.save(100, state(101), overwrite=True)
elif case == "retention":
    stop_after_uncommitting("step_0000000100")  # save(300)'s retention: step 100's manifest removed
try:
    act()
    mgr.wait()
    print(json.dumps({"raised": None}), flush=True)
except Exception as exc:
    outcome = {"raised": type(exc).__name__, "message": str(exc), "path": getattr(exc, "path", None)}
    print(json.dumps(outcome), flush=True)
"""

#: case -> the file A's resumed save must refuse to write (B's), in the step directory, and
#: how its error begins (a rank's write failure names the rank; the commit is the coordinator's).
REFUSED = {
    "shard": ("__0_0.distcp", "rank 0: "),
    "shard-thread": ("__0_0.distcp", "rank 0: "),
    "shard-process": ("__0_0.distcp", "rank 0: "),
    "node-shard": ("__0_0.distcp", "rank 0: "),
    "metadata": (".metadata", "rank 0: "),
    "manifest": ("ckptlib.json", ""),
    "node-manifest": ("ckptlib.json", ""),
}
#: case -> what A's resumed removal must refuse (its LockedError names it): A was paused inside
#: the removal of step 100 (its overwrite, its retention), just after uncommitting it; B then
#: saved step 100 anew in that directory. And the steps there afterwards.
REMOVING = {
    "overwrite": ("overwrite step 100", [100]),
    "node-overwrite": ("overwrite step 100", [100]),
    "retention": ("remove step_0000000100", [100, 300]),
}


def _files(step_dir: str) -> dict[str, tuple[int, int, bytes]]:
    """Each file of a step directory: (inode, mtime in ns, bytes): any write shows ({} once the
    directory is gone)."""
    out = {}
    for name in sorted(os.listdir(step_dir)) if os.path.isdir(step_dir) else []:
        path = os.path.join(step_dir, name)
        st = os.stat(path)
        with open(path, "rb") as f:
            out[name] = (st.st_ino, st.st_mtime_ns, f.read())
    return out


@pytest.mark.parametrize("case", [*REFUSED, *REMOVING])
def test_a_paused_holder_never_writes_into_the_step_another_writer_committed(tmp_path, case):
    root = str(tmp_path / "run")
    contested = 100 if case in REMOVING else 300
    env = dict(os.environ, CKPTLIB_LOCK_LEASE_S=str(LEASE_S))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_A, root, case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        _wait_stopped(proc)
        mgr_b = CheckpointManager(root, hold_lock=True)  # B keeps the lock while A is continued
        _take_over(mgr_b, contested, _state(contested, 3000.0))  # the very step A is writing, other values
        step_dir = os.path.join(root, f"step_{contested:010d}")
        b_files = _files(step_dir)
        b_lock = open_storage(root).read(LOCK_NAME)
        b_holder = mgr_b.lock_holder()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    # B's step is byte for byte as B committed it (no file rewritten, replaced, added or
    # removed), and so are its lock and `latest`.
    after = _files(step_dir)
    changed = sorted(n for n in set(after) | set(b_files) if after.get(n) != b_files.get(n))
    assert not changed, f"A's resumed save rewrote {changed} of B's step {contested}"
    assert sorted(b_files) == [".metadata", "__0_0.distcp", "ckptlib.json"]
    outcome = json.loads(out.strip().splitlines()[-1])
    if case in REFUSED:
        name, prefix = REFUSED[case]
        where = f"{step_dir}/{name}"
        want = {
            "raised": "StorageError",
            "message": f"{prefix}cannot write {where}: it exists already (another writer wrote it meanwhile; a save "
            "creates each of its files and never replaces one)",
            "path": where,
        }
        steps = [100, 300]
    else:
        what, steps = REMOVING[case]
        want = {
            "raised": "LockedError",
            "message": f"{root}: this manager's lock ({root}/{LOCK_NAME}) was removed while it held it; "
            f"pid {os.getpid()} on host {socket.gethostname()}, since {b_holder.created} holds it now. "
            f"Another writer may have written this root; refusing to {what}.",
            "path": root,
        }
    assert outcome == want, err
    assert open_storage(root).read(LOCK_NAME) == b_lock
    assert _steps(root) == steps
    assert os.readlink(os.path.join(root, "latest")) == f"step_{contested:010d}"
    into = _state(0, 0.0)
    assert mgr_b.load(into) == contested
    assert torch.equal(into["w"], torch.full((8,), 3000.0))
    mgr_b.close()
