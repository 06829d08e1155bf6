"""The forkserver every rank is forked from: it imports torch (and `DEFAULT_PRELOAD`) once, so a
launch costs a fork per rank instead of a torch import per rank."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from typing import Iterable

#: Modules the forkserver imports once; every rank is forked with them already loaded.
#: Missing ones are skipped silently (the forkserver ignores ImportError).
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "numpy",
    "ckptlib.testing.harness.rank_process",
)

_lock = threading.Lock()
_preload: list[str] = list(DEFAULT_PRELOAD)
_ctx = None


def add_preload(modules: Iterable[str]) -> None:
    """Ask the forkserver to import ``modules`` once (only effective before it starts)."""
    with _lock:
        for mod in modules:
            if not isinstance(mod, str):
                raise TypeError(f"module names must be str, got {mod!r}")
            if mod not in _preload:
                _preload.append(mod)


def _forkserver_module():
    from multiprocessing import forkserver

    return forkserver


def forkserver_pid() -> int | None:
    """Pid of this process's forkserver (the parent of every rank), None before it starts."""
    return getattr(_forkserver_module()._forkserver, "_forkserver_pid", None)


def _extra_sys_path() -> list[str]:
    """``sys.path`` entries a fresh interpreter would not have (project and test dirs)."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) if p}
    out = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        real = os.path.realpath(entry)
        if any(real == p or real.startswith(p + os.sep) for p in prefixes):
            continue
        if real not in out:
            out.append(real)
    return out


def start_forkserver():
    """Start this process's forkserver if needed (non-blocking) and return the context.

    The forkserver imports :data:`DEFAULT_PRELOAD` (plus :func:`add_preload` additions) in
    the background; the first launch waits for that (a few seconds: the torch import).
    """
    global _ctx
    with _lock:
        if _ctx is None:
            _ctx = multiprocessing.get_context("forkserver")
        ctx = _ctx
        ctx.set_forkserver_preload(list(_preload))
        fs = _forkserver_module()
        if fs._forkserver._forkserver_pid is not None:
            fs.ensure_running()  # restarts it if it died
            return ctx
        # Python < 3.12 does not give the forkserver our sys.path, so the preload could
        # not import modules that live in the project (ckptlib itself).  Hand it over
        # through PYTHONPATH, for the forkserver process only.
        old = os.environ.get("PYTHONPATH")
        extra = _extra_sys_path()
        try:
            if extra:
                os.environ["PYTHONPATH"] = os.pathsep.join(extra + ([old] if old else []))
            fs.ensure_running()
        finally:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old
        return ctx
