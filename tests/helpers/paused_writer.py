"""What the paused-lock-holder tests share (tests/manager/test_lock_fencing.py and
test_lock_fencing_files.py): writer A runs in a subprocess and stops itself (SIGSTOP) at the
point under test; writer B, the test's process, waits for A's lease to run out and takes the
root over."""

from __future__ import annotations

import os
import subprocess
import time
import warnings

import torch

from ckptlib import CheckpointManager
from ckptlib.errors import LockedError
from ckptlib.manager.lock import StaleLockWarning


def state(step: int, value: float | None = None) -> dict:
    return {"w": torch.full((8,), float(step if value is None else value)), "step": step}


def step_numbers(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit())


def wait_stopped(proc: subprocess.Popen) -> None:
    """Until A stopped itself (it prints "stopping" first); fails if it ended instead."""
    line = proc.stdout.readline()
    assert line.strip() == "stopping", (line, proc.stderr.read() if proc.poll() is not None else "")
    while True:
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)


def take_over(mgr_b: CheckpointManager, step: int, state: dict, *, overwrite: bool = False) -> str:
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


__all__ = ["state", "step_numbers", "take_over", "wait_stopped"]
