"""Progress of a long save or load, on rank 0 only: `progress=` of `save`, `async_save`, `load`
and `CheckpointManager`.

`progress=None` (the default) draws a bar on stderr when it is a terminal and nothing
otherwise (a job's log file gets no carriage returns); `True` draws it anyway, `False`
never; a callable is called as `fn(op, done, total)` (bytes of rank 0's shards; `total` None
while unknown) at most every `INTERVAL` seconds and once at the end, for a progress display
of one's own. Every update is also a DEBUG record on the `ckptlib.progress` logger with
`record.ckptlib_progress = {"op", "uri", "done", "total"}`, for a logging handler.

The bytes are rank 0's: the shard bytes it writes (a save) or reads from storage (a load);
on N ranks each rank moves about 1/N of the checkpoint at the same pace.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Any, Callable, Iterator

from ckptlib.errors import StateError

INTERVAL = 0.5  # seconds between two updates of a callable or the log
logger = logging.getLogger("ckptlib.progress")

_lock = threading.Lock()
_active: dict[int, "Progress"] = {}  # thread id -> the operation it reports


def check(setting: Any) -> None:
    """Refuse a `progress=` that is not None, a bool or a callable."""
    if not (setting is None or isinstance(setting, bool) or callable(setting)):
        raise StateError(f"progress must be None, True, False or a callable(op, done, total), got {setting!r}")


class Progress:
    """One operation's bytes on this rank, handed to a bar, a callable and the log."""

    def __init__(self, op: str, uri: str, setting: Any):
        self.op, self.uri = op, uri
        self.done, self.total = 0, None
        self.fn = setting if callable(setting) else None
        self.bar = None
        if setting is True or (setting is None and _is_terminal()):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=None, unit="B", unit_scale=True, unit_divisor=1024, desc=f"ckptlib {op}", leave=False)
        self._last = 0.0
        self._lock = threading.Lock()

    def add_total(self, nbytes: int) -> None:
        with self._lock:
            self.total = (self.total or 0) + int(nbytes)
            if self.bar is not None:
                self.bar.total = self.total
                self.bar.refresh()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += int(nbytes)
            if self.bar is not None:
                self.bar.update(int(nbytes))
            now = time.monotonic()
            if now - self._last >= INTERVAL:
                self._last = now
                self._emit()

    def close(self) -> None:
        with self._lock:
            self._emit()
            if self.bar is not None:
                self.bar.close()

    def _emit(self) -> None:
        if self.fn is not None:
            try:
                self.fn(self.op, self.done, self.total)
            except Exception as exc:  # noqa: BLE001 - a display never fails a checkpoint
                self.fn = None
                logger.warning(
                    "the progress callback raised %s: %s; no more progress for %s", type(exc).__name__, exc, self.op
                )
        if logger.isEnabledFor(logging.DEBUG):
            fields = {"op": self.op, "uri": self.uri, "done": self.done, "total": self.total}
            logger.debug(
                "%s %s: %d of %s bytes", self.op, self.uri, self.done, self.total, extra={"ckptlib_progress": fields}
            )


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def reporting(op: str, uri: str, setting: Any, rank: int) -> Iterator[Progress | None]:
    """Report `op`'s bytes moved in this thread (and the threads `adopt` lends it to) while
    inside; on rank 0 only, and not at all for `progress=False`."""
    check(setting)
    if (
        rank != 0
        or setting is False
        or (setting is None and not _is_terminal() and not logger.isEnabledFor(logging.DEBUG))
    ):
        yield None
        return
    progress = Progress(op, uri, setting)
    me = threading.get_ident()
    with _lock:
        outer = _active.get(me)
        _active[me] = progress
    try:
        yield progress
    finally:
        with _lock:
            if outer is None:
                _active.pop(me, None)
            else:
                _active[me] = outer
        progress.close()


def current() -> Progress | None:
    """The operation this thread reports to, if any."""
    return _active.get(threading.get_ident())


def adopt(progress: Progress | None) -> Callable[[], None]:
    """Let the calling thread (a worker of the operation) report to `progress`; returns the undo."""
    if progress is None:
        return lambda: None
    me = threading.get_ident()
    with _lock:
        _active[me] = progress

    def undo() -> None:
        with _lock:
            if _active.get(me) is progress:
                del _active[me]

    return undo


def advance(nbytes: int) -> None:
    """`nbytes` more moved by the operation this thread reports to (nothing when none)."""
    progress = _active.get(threading.get_ident())
    if progress is not None:
        progress.advance(nbytes)


def add_total(nbytes: int) -> None:
    progress = _active.get(threading.get_ident())
    if progress is not None:
        progress.add_total(nbytes)


__all__ = ["INTERVAL", "Progress", "add_total", "adopt", "advance", "check", "current", "reporting"]
