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

import os
import pickle
import shutil
import socket
import sys
import tempfile
from typing import Any, Callable

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

from ckptlib.testing.harness.forkserver import DEFAULT_PRELOAD, _preload, add_preload, forkserver_pid, start_forkserver  # noqa: F401  (_preload: tests slim the forkserver)
from ckptlib.testing.harness.launch_errors import (
    RankError,
    RankExited,
    RankFailure,
    RankTimeout,
    RemoteError,
    SkipLaunch,
)
from ckptlib.testing.harness.rank_process import _FdForChild, _rank_main, _RankSpec
from ckptlib.testing.harness.supervision import (
    _clean_dump,
    _dump_stacks,
    _fn_name,
    _format_report,
    _mark_first,
    _Rank,
    _supervise,
    _terminate,
)

DEFAULT_TIMEOUT = 120.0
DEFAULT_GRACE = 5.0
# Extra seconds the ranks' process-group timeout gets over the launch timeout, so that
# a hang is caught by the launcher (which dumps stacks) rather than by a collective.
_PG_TIMEOUT_MARGIN = 30.0


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
      on their own before they are killed.  With ``return_exceptions`` every rank's result
      is waited for (up to ``timeout``), and ``grace`` only bounds the exit of a rank that
      returned (it may wait for a dead peer at an exit barrier).
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
        common = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_WORLD_SIZE": str(nodes),
            "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
        }
        if rendezvous == "tcp":
            from datetime import timedelta

            import torch.distributed as dist

            tcp_store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=pg_timeout), wait_for_workers=False)
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
            environ.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank % local_world_size),
                    "GROUP_RANK": str(rank // local_world_size),
                    "ROLE_RANK": str(rank),
                }
            )
            for key, value in (env or {}).items():
                if value is None:
                    environ.pop(key, None)
                else:
                    environ[str(key)] = str(value)
            stack_path = os.path.join(tmpdir, f"rank{rank}.stacks")
            res_r, res_w = ctx.Pipe(duplex=False)
            spec = _RankSpec(
                rank,
                world_size,
                local_world_size,
                backend,
                store_spec,
                pg_timeout,
                environ,
                stack_path,
                payload,
                rewrite,
                res_w,
                alive_r,
                stdout,
                stderr,
            )
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

        timed_out, grace_end = _supervise(ranks, timeout, grace, wait_for_results=return_exceptions)
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
                    what = "returned its result but did not exit" if rk.outcome is not None else "was still running"
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
                if isinstance(rk.failure.exception, RankExited):
                    rk.failure.exception.stack_dump = rk.failure.stack_dump
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
        header = (
            f"launch of {name} on {world_size} ranks timed out after {timeout:.1f} s; "
            f"{len(failures)} rank(s) did not finish (stack dumps below)"
        )
        raise RankTimeout(_format_report(header, ranks), failures, results)
    if return_exceptions:
        _mark_first(ranks)
        return results
    first = _mark_first(ranks)
    header = f"{len(failures)} of {world_size} ranks failed running {name} (first failure: rank {first})"
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
