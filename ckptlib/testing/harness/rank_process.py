"""The rank side of a launch: what runs in each forked process (`_rank_main`): process group
set-up, the call of `fn`, results and errors sent back, and dying with the launcher."""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import importlib.abc
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

from ckptlib.testing.harness.parent_death import die_with_parent

_READY = b"R"
_UP_KEY = "ckptlib.testing/up"


class _FdForChild:
    """Pickles as a duplicate of ``fd`` handed to the child by the forkserver."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_detach_fd, (reduction.DupFd(self.fd),))


def _detach_fd(dupfd) -> int:
    fd = dupfd.detach()
    os.set_inheritable(fd, False)
    return fd


@dataclasses.dataclass
class _RankSpec:
    rank: int
    world_size: int
    local_world_size: int
    backend: str
    store: tuple  # ("tcp", host, port) or ("file", path)
    pg_timeout: float
    environ: dict
    stack_path: str
    payload: bytes
    rewrite: dict
    result_conn: Any
    alive_conn: Any
    stdout: Any
    stderr: Any


_stack_file = None  # keeps the faulthandler file open for the rank's lifetime


def _watch_launcher(conn) -> None:
    # The launcher holds the write end and never writes: EOF means it is gone.
    try:
        conn.recv_bytes()
    except BaseException:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


class _RewriteFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the modules pytest rewrote in the launcher with the same assert rewriting."""

    def __init__(self, mapping: dict):
        self.mapping = mapping

    def find_spec(self, name, path=None, target=None):
        fn = self.mapping.get(name)
        if fn is None or not os.path.isfile(fn):
            return None
        locations = [os.path.dirname(fn)] if os.path.basename(fn) == "__init__.py" else None
        return importlib.util.spec_from_file_location(name, fn, loader=self, submodule_search_locations=locations)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        fn = module.__spec__.origin
        exec(_rewritten_code(fn), module.__dict__)


def _rewritten_code(fn: str):
    try:
        import ast
        from pathlib import Path

        from _pytest.assertion import rewrite as rw

        path = Path(fn)
        co = None
        try:  # pytest's own cache of the rewritten module
            co = rw._read_pyc(path, rw.get_cache_dir(path) / (path.name[:-3] + rw.PYC_TAIL))
        except Exception:
            co = None
        if co is None:
            source = path.read_bytes()
            tree = ast.parse(source, filename=fn)
            rw.rewrite_asserts(tree, source, fn, None)
            co = compile(tree, fn, "exec", dont_inherit=True)
        return co
    except Exception:
        with open(fn, "rb") as f:
            return compile(f.read(), fn, "exec", dont_inherit=True)


def _trim_traceback(exc: BaseException):
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") == __name__:
        tb = tb.tb_next
    return tb


def _pack_error(exc: BaseException, note: str | None = None) -> bytes:
    when = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable across ranks
    try:
        text = "".join(traceback.format_exception(type(exc), exc, _trim_traceback(exc)))
    except Exception:
        text = f"<traceback could not be formatted>\n{type(exc).__name__}\n"
    if note:
        text = f"{note}\n{text}"
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__", None):
        name = f"{module}.{name}"
    try:
        blob = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)
    except BaseException:
        blob = None
    return pickle.dumps(("error", name, message, text, blob, when), protocol=pickle.HIGHEST_PROTOCOL)


def _rank_main(spec: _RankSpec) -> None:
    """Entry point of every rank (runs in the forked child)."""
    global _stack_file
    die_with_parent()  # with the forkserver
    threading.Thread(
        target=_watch_launcher, args=(spec.alive_conn,), daemon=True, name="ckptlib-launcher-watch"
    ).start()
    for target, fd in ((1, spec.stdout), (2, spec.stderr)):
        if isinstance(fd, int):
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(spec.environ)
    _stack_file = open(spec.stack_path, "w")
    faulthandler.enable(file=_stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)
    conn = spec.result_conn
    conn.send_bytes(_READY)

    code = 0
    stage = "loading the function"
    store = None
    timeout = None
    checked_in = False
    try:
        if spec.rewrite:
            sys.meta_path.insert(0, _RewriteFinder(spec.rewrite))
        fn, args, kwargs = pickle.loads(spec.payload)
        stage = "initialising the process group"
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if "OMP_NUM_THREADS" in os.environ:
            try:
                torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
            except ValueError:
                pass
        timeout = timedelta(seconds=spec.pg_timeout)
        if "nccl" in spec.backend:
            torch.cuda.set_device(spec.rank)  # == LOCAL_RANK on a single (simulated) node
        if spec.store[0] == "tcp":
            store = dist.TCPStore(spec.store[1], spec.store[2], spec.world_size, False, timeout)
        else:
            store = dist.FileStore(spec.store[1], spec.world_size)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
        store.set(f"{_UP_KEY}/{spec.rank}", "1")
        checked_in = True
        stage = "running the function"
        value = fn(*args, **kwargs)
        stage = "pickling the result"
        data = pickle.dumps(("ok", value), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the launcher
        note = None if stage == "running the function" else f"(rank {spec.rank} failed while {stage})"
        data = _pack_error(exc, note)
        code = 1
    try:
        conn.send_bytes(data)
    except BaseException:
        code = code or 2
    if store is not None:
        # Leave only once every peer got through init_process_group (or gave up on it):
        # a rank that exits while a slower peer is still in gloo's connectFullMesh
        # breaks that peer's handshake ("Connection closed by peer").  The store
        # outlives a broken group.  Ranks blocked in a collective are past init, so a
        # failed rank does not wait for them; it waits only for ranks stuck before
        # init, and the launcher, which has its result already, kills it after the grace.
        try:
            if not checked_in:
                store.set(f"{_UP_KEY}/{spec.rank}", "1")
            store.wait([f"{_UP_KEY}/{r}" for r in range(spec.world_size)], timeout)
        except BaseException:
            pass
    del store
    if code != 0:
        _flush_std_streams()
        sys.exit(code)
    # Success: run the exit handlers (an async save's wait, a lock's release) while the
    # process groups still exist, then leave without destroy_process_group: the result is
    # already with the launcher, and destroy can hang in C holding the GIL (seen on torch
    # 2.6 in ~1 of 12 four-rank launches), where no Python-level timeout can interrupt it.
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - reported, and the rank exits non-zero
        traceback.print_exc()
        code = 3
    _flush_std_streams()
    os._exit(code)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
