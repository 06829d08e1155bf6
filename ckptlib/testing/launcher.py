"""Run a function in N fresh processes that form a ``torch.distributed`` group.

``launch(world_size, fn, *args, **kwargs)`` starts ``world_size`` processes, initialises a
process group in each (rank ``r`` of ``world_size``), calls ``fn(*args, **kwargs)`` on every
rank and returns the per-rank return values in rank order.

Speed: the processes come from a ``multiprocessing`` *forkserver* that imported torch (and
``torch.distributed.checkpoint``) once, so a launch costs a fork per rank instead of a torch
import per rank.  Every launch still gets new processes: nothing is shared between launches
and a rank that crashed cannot affect the next launch.

Isolation and cleanup: rendezvous goes through a TCPStore that this process hosts on a port
the kernel picks on 127.0.0.1 (or a FileStore in a fresh temporary directory), so concurrent
launches (threads, pytest-xdist workers) never meet.  Every rank is killed and reaped before
``launch`` returns or raises (also on KeyboardInterrupt); ranks also kill themselves when the
launching process dies.

Failures: an exception on a rank, a rank that dies, or a launch running past ``timeout``
raise :class:`RankError` (:class:`RankTimeout` for the last) with every failing rank's
traceback or stack dump.  ``return_exceptions=True`` returns the per-rank exception objects
instead (hangs still raise :class:`RankTimeout`).

Caveats of the forkserver: modules it preloaded are imported once, before your environment
variables reach the ranks, so variables read at import time by torch (``TORCH_*``) keep the
value they had when the forkserver started; ``os.environ`` itself is copied from the
launching process at every launch.  Functions and arguments are pickled: ``fn`` must be
defined at module level of an importable module (``__main__`` works, as with ``spawn``).

This module imports only the standard library at import time; torch is imported inside
:func:`launch`.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import faulthandler
import importlib.abc
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Iterable

__all__ = [
    "DEFAULT_PRELOAD",
    "DEFAULT_TIMEOUT",
    "RankError",
    "RankExited",
    "RankFailure",
    "RankTimeout",
    "RemoteError",
    "SkipLaunch",
    "add_preload",
    "forkserver_pid",
    "gpu_skip_reason",
    "launch",
    "start_forkserver",
]

DEFAULT_TIMEOUT = 120.0
DEFAULT_GRACE = 5.0
#: Modules the forkserver imports once; every rank is forked with them already loaded.
#: Missing ones are skipped silently (the forkserver ignores ImportError).
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "numpy",
    "ckptlib.testing.launcher",
)
# Extra seconds the ranks' process-group timeout gets over the launch timeout, so that
# a hang is caught by the launcher (which dumps stacks) rather than by a collective.
_PG_TIMEOUT_MARGIN = 30.0
_DUMP_WAIT = 1.0
_DEATH_WINDOW = 1.0
_READY = b"R"
_UP_KEY = "ckptlib.testing/up"


# --------------------------------------------------------------------------- exceptions


class SkipLaunch(Exception):
    """The launch cannot run on this machine (e.g. ``backend="nccl"`` without enough GPUs).

    The pytest plugin turns it into a skip carrying the same reason.
    """


class RemoteError(Exception):
    """Stands in for a rank's exception that could not be pickled back to the launcher."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "", rank: int | None = None):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text
        self.rank = rank

    def __reduce__(self):
        return (type(self), (self.type_name, self.message, self.traceback_text, self.rank))


class RankExited(Exception):
    """A rank ended without returning a result: it died, or the launcher killed it."""

    def __init__(self, rank: int, exitcode: int | None, reason: str):
        super().__init__(f"rank {rank} {reason}")
        self.rank = rank
        self.exitcode = exitcode
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.rank, self.exitcode, self.reason))


@dataclasses.dataclass
class RankFailure:
    """What went wrong on one rank.

    ``kind`` is ``"error"`` (the function raised), ``"exited"`` (the process died or exited
    without a result), ``"killed"`` (still running after the grace period that followed
    another rank's failure) or ``"timeout"`` (still running at the launch timeout).
    """

    rank: int
    kind: str
    summary: str
    exception: BaseException
    type_name: str | None = None
    message: str | None = None
    traceback: str = ""
    exitcode: int | None = None
    stack_dump: str = ""
    first: bool = False


class RankError(Exception):
    """One or more ranks of a :func:`launch` failed.

    ``failures`` maps rank -> :class:`RankFailure`; ``results`` holds, per rank, the
    returned value or the exception object (as ``return_exceptions=True`` would return).
    """

    def __init__(self, message: str, failures: dict | None = None, results: list | None = None):
        super().__init__(message)
        self.failures: dict[int, RankFailure] = dict(failures or {})
        self.results: list = list(results or [])

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class RankTimeout(RankError):
    """The launch ran past its timeout; the message holds each live rank's stack dump."""


# --------------------------------------------------------------------------- forkserver

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


# --------------------------------------------------------------------------- GPU checks


def gpu_skip_reason(world_size: int = 1, backend: str = "nccl") -> str | None:
    """Why ``world_size`` ranks cannot run with ``backend`` on CUDA here, or None if they can."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # pragma: no cover - torch is a hard dependency
        return f"torch cannot be imported: {exc}"
    if not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
        return f"CUDA is not available (torch {torch.__version__}, built with {built})"
    if "nccl" in backend and not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    count = torch.cuda.device_count()
    if count < world_size:
        return f"{world_size} ranks need {world_size} CUDA devices, found {count}"
    return None


# --------------------------------------------------------------------------- child side


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


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the forkserver
    except Exception:
        pass


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
        return importlib.util.spec_from_file_location(
            name, fn, loader=self, submodule_search_locations=locations
        )

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
    _set_pdeathsig()
    threading.Thread(target=_watch_launcher, args=(spec.alive_conn,), daemon=True,
                     name="ckptlib-launcher-watch").start()
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
        dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                world_size=spec.world_size, timeout=timeout)
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


# --------------------------------------------------------------------------- parent side


class _Rank:
    def __init__(self, rank: int, proc, conn, stack_path: str):
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.stack_path = stack_path
        self.ready = False
        self.eof = False
        self.eof_time: float | None = None
        self.outcome: tuple | None = None
        self.exitcode: int | None = None
        self.failure: RankFailure | None = None
        self.fail_time = float("inf")
        self.dump = ""

    @property
    def alive(self) -> bool:
        return self.exitcode is None

    def drain(self) -> None:
        while not self.eof:
            try:
                if not self.conn.poll(0):
                    return
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                self.eof = True
                self.eof_time = time.monotonic()  # ~ when the process ended
                return
            if data == _READY:
                self.ready = True
                continue
            try:
                self.outcome = pickle.loads(data)
            except Exception as exc:
                self.outcome = ("error", type(exc).__name__,
                                f"the result of rank {self.rank} could not be unpickled in the launcher: {exc}",
                                traceback.format_exc(), None, time.monotonic())

    def stack_size(self) -> int:
        try:
            return os.path.getsize(self.stack_path)
        except OSError:
            return 0

    def read_stacks(self, offset: int = 0) -> str:
        try:
            with open(self.stack_path, "r", errors="replace") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"signal {name} (exit code {code})"
    return f"exit code {code}"


def _dump_stacks(ranks: list[_Rank]) -> None:
    """SIGUSR1 every live, ready rank; wait up to ~1 s for faulthandler to write the dumps."""
    sizes = {}
    for rk in ranks:
        if rk.alive and rk.ready:
            sizes[rk] = rk.stack_size()
            try:
                os.kill(rk.proc.pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                sizes.pop(rk)
    if not sizes:
        return
    end = time.monotonic() + _DUMP_WAIT
    last = {rk: -1 for rk in sizes}
    while time.monotonic() < end:
        now_sizes = {rk: rk.stack_size() for rk in sizes}
        grown = all(now_sizes[rk] > sizes[rk] for rk in sizes)
        stable = all(now_sizes[rk] == last[rk] for rk in sizes)
        if grown and stable:
            break
        last = now_sizes
        time.sleep(0.03)
    for rk, offset in sizes.items():
        text = rk.read_stacks(offset)
        if text:
            rk.dump += text if not rk.dump else "\n" + text


def _terminate(ranks: list[_Rank]) -> None:
    for rk in ranks:
        proc = rk.proc
        if proc is None:
            continue
        try:
            if proc.exitcode is None:
                proc.kill()
        except Exception:
            pass
    for rk in ranks:
        proc = rk.proc
        if proc is None:
            continue
        try:
            proc.join(10.0)
            if rk.exitcode is None:
                rk.exitcode = proc.exitcode
        except Exception:
            pass


def _fn_name(fn) -> str:
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}" if mod else name


def _make_error_failure(rk: _Rank) -> RankFailure:
    _, type_name, message, tb, blob, _when = rk.outcome
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(type_name, message, tb, rk.rank)
    else:
        try:
            exc.add_note(f"[raised on rank {rk.rank}; remote traceback]\n{tb.rstrip()}")
        except Exception:
            pass
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    if len(first_line) > 160:
        first_line = first_line[:157] + "..."
    summary = f"{type_name}: {first_line}" if first_line else type_name
    return RankFailure(rk.rank, "error", summary, exc, type_name, message, tb, rk.exitcode)


def _supervise(ranks: list[_Rank], timeout: float, grace: float) -> tuple[bool, float | None]:
    """Wait for every rank; returns (timed_out, grace) and fills in ``rk.failure``."""
    deadline = time.monotonic() + timeout
    grace_end = None
    while True:
        live = [rk for rk in ranks if rk.alive]
        if not live:
            return False, grace_end
        now = time.monotonic()
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            return grace_end is None, grace_end
        objs = []
        for rk in live:
            objs.append(rk.proc.sentinel)
            if not rk.eof:
                objs.append(rk.conn)
        ready = multiprocessing.connection.wait(objs, timeout=max(0.0, limit - now))
        died = []
        for rk in live:
            if not rk.eof and rk.conn in ready:
                rk.drain()
            if rk.proc.sentinel in ready:
                rk.drain()  # a result is always written before the process exits
                rk.exitcode = rk.proc.exitcode
                if rk.exitcode is None:  # pragma: no cover - sentinel ready means exited
                    rk.proc.join(1.0)
                    rk.exitcode = rk.proc.exitcode
        for rk in ranks:
            if rk.failure is not None:
                continue
            if rk.outcome is not None and rk.outcome[0] == "error":
                rk.failure = _make_error_failure(rk)
                rk.fail_time = rk.outcome[5]
            elif not rk.alive and rk.outcome is None:
                how = _describe_exit(rk.exitcode)
                reason = f"exited with {how} without returning a result"
                rk.failure = RankFailure(rk.rank, "exited", reason,
                                         RankExited(rk.rank, rk.exitcode, reason), exitcode=rk.exitcode)
                died.append(rk)
            elif not rk.alive and rk.exitcode != 0:
                how = _describe_exit(rk.exitcode)
                reason = f"returned a result but then exited with {how}"
                rk.failure = RankFailure(rk.rank, "exited", reason,
                                         RankExited(rk.rank, rk.exitcode, reason), exitcode=rk.exitcode)
                died.append(rk)
            else:
                continue
            if rk.fail_time == float("inf"):
                rk.fail_time = rk.eof_time or time.monotonic()
        if grace_end is None and any(rk.failure is not None for rk in ranks):
            grace_end = time.monotonic() + grace
        if died:
            # where were the others when a rank vanished?
            _dump_stacks([rk for rk in ranks if rk.alive and rk.outcome is None])


# Errors a rank gets because a *peer* failed: they point at the victim, not the cause.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker"
    r"|communicator was aborted|has been aborted",
    re.IGNORECASE,
)


def _mark_first(ranks: list[_Rank]) -> int | None:
    """Flag the failure that most likely caused the others (earliest primary failure)."""
    failed = [rk for rk in ranks if rk.failure is not None]
    if not failed:
        return None
    causes = [rk for rk in failed if rk.failure.kind in ("error", "exited")]
    primary = [rk for rk in causes
               if not (rk.failure.kind == "error" and _SECONDARY.search(rk.failure.message or ""))]
    pool = primary or causes or failed
    first = min(pool, key=lambda rk: (rk.fail_time, rk.rank))
    # A dead rank is only noticed here after the fact, while its peers timestamp the
    # errors its death causes themselves: a death seen shortly after wins.
    deaths = [rk for rk in pool if rk.failure.kind == "exited"
              and rk.fail_time <= first.fail_time + _DEATH_WINDOW]
    if deaths:
        first = min(deaths, key=lambda rk: (rk.fail_time, rk.rank))
    first.failure.first = True
    return first.rank


def _clean_dump(text: str) -> str:
    """Drop the harness's own frames and threads from a faulthandler dump."""
    blocks = re.split(r"\n\s*\n", text.strip())
    out = []
    for block in blocks:
        if "in _watch_launcher" in block:
            continue
        kept = []
        for line in block.splitlines():
            if line.rstrip().endswith(" in _rank_main") and "launcher.py" in line:
                break
            kept.append(line)
        if kept:
            out.append("\n".join(kept))
    return "\n\n".join(out)


def _format_report(header: str, ranks: list[_Rank]) -> str:
    failed = [rk for rk in ranks if rk.failure is not None]
    failed.sort(key=lambda rk: (not rk.failure.first, rk.rank))
    lines = [header]
    ok = [rk.rank for rk in ranks if rk.failure is None]
    if ok:
        lines.append(f"ranks that returned normally: {ok}")
    for rk in failed:
        f = rk.failure
        tag = " (first failure)" if f.first and len(failed) > 1 else ""
        lines.append("")
        lines.append(f"--- rank {rk.rank}{tag}: {f.summary} ---")
        if f.traceback:
            lines.append(f.traceback.rstrip())
        if f.stack_dump.strip():
            lines.append(f"stack dump of rank {rk.rank}:")
            lines.append(f.stack_dump.rstrip())
        elif f.kind in ("killed", "timeout"):
            lines.append(f"(no stack dump from rank {rk.rank})")
    return "\n".join(lines)


def launch(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str | None] | None = None,
    nodes: int = 1,
    return_exceptions: bool = False,
    grace: float = DEFAULT_GRACE,
    pg_timeout: float | None = None,
    rendezvous: str = "tcp",
    fn_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks of a fresh process group.

    Returns the per-rank return values, in rank order (they must be picklable).

    - ``backend``: process-group backend (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``).
      With NCCL, rank ``r`` uses ``cuda:r`` (its LOCAL_RANK on a single node); too few
      GPUs raise :class:`SkipLaunch`.
    - ``timeout``: seconds for the whole launch (after the processes started).  On expiry
      every live rank's stack is dumped (faulthandler, SIGUSR1), all are killed and
      :class:`RankTimeout` is raised.
    - ``env``: extra environment variables for every rank (``None`` removes one).  The
      ranks start from this process's current ``os.environ``; RANK, WORLD_SIZE,
      LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR
      (127.0.0.1) and, with the TCP rendezvous, MASTER_PORT are set.  OMP_NUM_THREADS
      defaults to 1 when several ranks share a node (like torchrun).
    - ``nodes``: simulate this many nodes of ``world_size // nodes`` ranks each
      (LOCAL_RANK = rank % local_world_size, GROUP_RANK = rank // local_world_size).
    - ``return_exceptions``: return each failing rank's exception object (the original one
      when it pickles, else :class:`RemoteError`; :class:`RankExited` for a rank that died
      or was killed) in place of its value instead of raising :class:`RankError`.
    - ``grace``: after the first failure the other ranks get this long to finish or fail
      on their own before they are killed.
    - ``pg_timeout``: the process group's timeout in the ranks (default ``timeout`` + 30 s
      so that the launcher, not a collective, notices a hang).
    - ``rendezvous``: ``"tcp"`` (a TCPStore hosted here on 127.0.0.1, port chosen by the
      kernel) or ``"file"`` (a FileStore in a fresh temporary directory).
    - ``fn_kwargs``: keyword arguments for ``fn``, merged with ``**kwargs``; use it for
      names that collide with this function's own parameters.
    """
    __tracebackhide__ = True
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise ValueError(f"nodes={nodes!r} must be a positive divisor of world_size={world_size}")
    if rendezvous not in ("tcp", "file"):
        raise ValueError(f"rendezvous must be 'tcp' or 'file', got {rendezvous!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    timeout = float(timeout)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if "nccl" in backend:
        reason = gpu_skip_reason(world_size, backend)
        if reason:
            raise SkipLaunch(f"backend {backend!r}: {reason}")
    if fn_kwargs:
        overlap = set(fn_kwargs) & set(kwargs)
        if overlap:
            raise TypeError(f"keyword arguments given twice: {sorted(overlap)}")
        kwargs = {**kwargs, **fn_kwargs}
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"launch: cannot send {_fn_name(fn)} and its arguments to the ranks: {exc}. "
            "The function must be defined at module level of an importable module and "
            "its arguments and keyword arguments must be picklable."
        ) from exc
    local_world_size = world_size // nodes
    pg_timeout = float(pg_timeout) if pg_timeout is not None else timeout + _PG_TIMEOUT_MARGIN
    rewrite = _assert_rewrite_map()

    ctx = start_forkserver()
    tmpdir = tempfile.mkdtemp(prefix="ckptlib-launch-")
    ranks: list[_Rank] = []
    tcp_store = None
    alive_r = alive_w = None
    try:
        base_env = dict(os.environ)
        common = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(local_world_size),
                  "GROUP_WORLD_SIZE": str(nodes), "ROLE_WORLD_SIZE": str(world_size),
                  "MASTER_ADDR": "127.0.0.1"}
        if rendezvous == "tcp":
            from datetime import timedelta

            import torch.distributed as dist

            tcp_store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=pg_timeout),
                                      wait_for_workers=False)
            store_spec: tuple = ("tcp", "127.0.0.1", int(tcp_store.port))
            common["MASTER_PORT"] = str(tcp_store.port)
            common["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store lives in the launcher
        else:
            store_spec = ("file", os.path.join(tmpdir, "filestore"))
            base_env.pop("MASTER_PORT", None)
        if "GLOO_SOCKET_IFNAME" not in base_env and not (env and "GLOO_SOCKET_IFNAME" in env):
            lo = _loopback_ifname()
            if lo:
                common["GLOO_SOCKET_IFNAME"] = lo  # keep gloo on loopback
        if local_world_size > 1 and "OMP_NUM_THREADS" not in base_env:
            common["OMP_NUM_THREADS"] = "1"
        alive_r, alive_w = ctx.Pipe(duplex=False)
        stdout = _FdForChild(1) if _fd_ok(1) else None
        stderr = _FdForChild(2) if _fd_ok(2) else None
        for rank in range(world_size):
            environ = dict(base_env)
            environ.update(common)
            environ.update({
                "RANK": str(rank), "LOCAL_RANK": str(rank % local_world_size),
                "GROUP_RANK": str(rank // local_world_size), "ROLE_RANK": str(rank),
            })
            for key, value in (env or {}).items():
                if value is None:
                    environ.pop(key, None)
                else:
                    environ[str(key)] = str(value)
            stack_path = os.path.join(tmpdir, f"rank{rank}.stacks")
            res_r, res_w = ctx.Pipe(duplex=False)
            spec = _RankSpec(rank, world_size, local_world_size, backend, store_spec, pg_timeout,
                             environ, stack_path, payload, rewrite, res_w, alive_r, stdout, stderr)
            proc = ctx.Process(target=_rank_main, args=(spec,), name=f"ckptlib-rank{rank}")
            rk = _Rank(rank, None, res_r, stack_path)
            ranks.append(rk)
            try:
                proc.start()
            finally:
                res_w.close()
            rk.proc = proc
        alive_r.close()
        alive_r = None

        timed_out, grace_end = _supervise(ranks, timeout, grace)
        leftover = [rk for rk in ranks if rk.alive]
        if leftover:
            _dump_stacks(leftover)
            all_returned = all(r.outcome is not None for r in ranks)
            for rk in leftover:
                if rk.failure is not None:
                    continue
                if rk.outcome is not None and not (timed_out and all_returned):
                    continue  # returned; waiting at the exit barrier for a failed peer
                if timed_out:
                    what = ("returned its result but did not exit" if rk.outcome is not None
                            else "was still running")
                    reason = f"{what} at the {timeout:.1f} s timeout; killed"
                    kind = "timeout"
                else:
                    reason = f"was still running {grace:.1f} s after the first failure; killed"
                    kind = "killed"
                rk.failure = RankFailure(rk.rank, kind, reason, RankExited(rk.rank, None, reason))
        _terminate(ranks)
        for rk in ranks:
            if rk.failure is not None:
                if rk.dump:
                    rk.failure.stack_dump = _clean_dump(rk.dump)
                elif rk.failure.kind == "exited":
                    rk.failure.stack_dump = _clean_dump(rk.read_stacks())  # fatal-signal traceback
                if rk.failure.exitcode is None and rk.failure.kind == "error":
                    rk.failure.exitcode = rk.exitcode
    finally:
        _terminate(ranks)
        for rk in ranks:
            try:
                rk.conn.close()
            except Exception:
                pass
        for conn in (alive_r, alive_w):
            if conn is not None:
                conn.close()
        del tcp_store
        shutil.rmtree(tmpdir, ignore_errors=True)

    results = []
    for rk in ranks:
        if rk.failure is not None:
            results.append(rk.failure.exception)
        else:
            results.append(rk.outcome[1])
    failures = {rk.rank: rk.failure for rk in ranks if rk.failure is not None}
    if not failures:
        return results
    name = _fn_name(fn)
    if timed_out:
        header = (f"launch of {name} on {world_size} ranks timed out after {timeout:.1f} s; "
                  f"{len(failures)} rank(s) did not finish (stack dumps below)")
        raise RankTimeout(_format_report(header, ranks), failures, results)
    if return_exceptions:
        _mark_first(ranks)
        return results
    first = _mark_first(ranks)
    header = (f"{len(failures)} of {world_size} ranks failed running {name} "
              f"(first failure: rank {first})")
    raise RankError(_format_report(header, ranks), failures, results)


def _fd_ok(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _loopback_ifname() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for cand in ("lo", "lo0"):
        if cand in names:
            return cand
    return None


def _assert_rewrite_map() -> dict:
    """Module name -> file of every module pytest rewrote here (test modules, conftests)."""
    for finder in sys.meta_path:
        if type(finder).__name__ == "AssertionRewritingHook":
            names = getattr(finder, "_rewritten_names", None)
            if isinstance(names, dict):
                return {str(k): str(v) for k, v in names.items()}
    return {}
