"""The launcher side of a launch: watching the ranks (`_supervise`), stack dumps of hung ranks,
termination, and the failure report."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import re
import signal
import time
import traceback

from ckptlib.testing.harness.launch_errors import RankExited, RankFailure, RemoteError
from ckptlib.testing.harness.rank_process import _READY

_DUMP_WAIT = 1.0
_DEATH_WINDOW = 1.0


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
                self.outcome = (
                    "error",
                    type(exc).__name__,
                    f"the result of rank {self.rank} could not be unpickled in the launcher: {exc}",
                    traceback.format_exc(),
                    None,
                    time.monotonic(),
                )

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


def _supervise(
    ranks: list[_Rank], timeout: float, grace: float, wait_for_results: bool = False
) -> tuple[bool, float | None]:
    """Wait for every rank; returns (timed_out, grace end) and fills in ``rk.failure``.

    After the first failure the others get ``grace`` seconds to finish; with
    ``wait_for_results`` a rank that has not returned yet is waited for until the timeout
    (its result is what the caller asked for, however long a loaded machine takes to produce
    it), and only the exits of ranks that returned are cut to ``grace``."""
    deadline = time.monotonic() + timeout
    grace_end = None
    results_in = False
    while True:
        live = [rk for rk in ranks if rk.alive]
        if not live:
            return False, grace_end
        now = time.monotonic()
        pending = any(rk.outcome is None for rk in live)
        if grace_end is not None and wait_for_results and not pending and not results_in:
            results_in = True  # every live rank has returned: now only their exits are waited for
            grace_end = now + grace
        limit = deadline
        if grace_end is not None and not (wait_for_results and pending):
            limit = min(deadline, grace_end)
        if now >= limit:
            return now >= deadline, grace_end
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
                rk.failure = RankFailure(
                    rk.rank, "exited", reason, RankExited(rk.rank, rk.exitcode, reason), exitcode=rk.exitcode
                )
                died.append(rk)
            elif not rk.alive and rk.exitcode != 0:
                how = _describe_exit(rk.exitcode)
                reason = f"returned a result but then exited with {how}"
                rk.failure = RankFailure(
                    rk.rank, "exited", reason, RankExited(rk.rank, rk.exitcode, reason), exitcode=rk.exitcode
                )
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
    primary = [rk for rk in causes if not (rk.failure.kind == "error" and _SECONDARY.search(rk.failure.message or ""))]
    pool = primary or causes or failed
    first = min(pool, key=lambda rk: (rk.fail_time, rk.rank))
    # A dead rank is only noticed here after the fact, while its peers timestamp the
    # errors its death causes themselves: a death seen shortly after wins.
    deaths = [rk for rk in pool if rk.failure.kind == "exited" and rk.fail_time <= first.fail_time + _DEATH_WINDOW]
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
            if line.rstrip().endswith(" in _rank_main") and "rank_process.py" in line:
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
