"""Every process the harness starts ends with the process that started it, however that one
ends (a CI timeout's SIGKILL, Ctrl-C, a closed terminal): Linux's parent-death signal.

A pytest run killed mid-test used to leave its xdist workers, the emulators (fake-gcs-server,
Azurite: started in sessions of their own), and torchrun launchers running, competing with the
next run for ports and cores. Rank processes (`rank_process`), the forkserver (it exits when
its client's pipe closes) and ckptlib's writer processes (`saving.writer_child` watches its
parent) already ended with their parent. The signal is delivered when the *thread* that started
the child ends, so each user starts its children from a thread that lives as long as it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """This process gets `sig` once its parent is gone (nothing where prctl is missing)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(sig))


def preexec_die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` that gives the child `sig` when this process's
    calling thread ends, and ends a child whose parent is gone before the signal was set.
    prctl is looked up here, in the parent, so the child only calls it."""
    prctl, parent = _prctl(), os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(1)

    return preexec
