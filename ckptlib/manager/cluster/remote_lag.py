"""Training survives the remote: how far the remote may fall behind while it is unreachable.

A save whose local commit succeeded never fails because the remote is down. An upload that
fails for want of the remote (storage errors, a remote that cannot be reached or locked for
that reason; not a lock another writer holds, not a lost rank, not a damaged local copy)
leaves the step local, says so with a `RemoteUnavailableWarning` naming the steps not yet
remote, and is tried again at a later save: after `RemoteLag.retry_after` seconds, doubling
after each failure up to `MAX_BACKOFF`, the newest step is uploaded (uploads of the saves in
between are skipped, not queued, unless skipping one would pass the limit). The remote
`latest` still only ever names a complete, verified copy. `mgr.remote_lag` reports where it
stands. At the end of a job nothing is left to a later save that cannot come: `close()`
uploads the newest step left local whatever the wait, or raises a `RemoteLagError` naming it;
`wait()` uploads it once the wait is over when its upload was skipped (`upkeep`).

Strictness is opt-in: `RemoteLag(steps=N)` makes the save that leaves more than N steps not
uploaded fail (`RemoteLagError`, an `UploadError`; `steps=0`: every failed upload is an
error), `RemoteLag(seconds=S)` the one that finds the oldest of them saved more than S
seconds ago; the save's upload runs in the background, so the error reaches every rank at the
next call that waits for it. Time is rank 0's: its decisions reach every rank.
"""

from __future__ import annotations

import dataclasses
import time

from ckptlib._runtime import agree as _dist
from ckptlib.errors import RankLostError, RemoteLagError, StateError, UploadError

#: The longest wait between two attempts on an unreachable remote, in seconds.
MAX_BACKOFF = 600.0


@dataclasses.dataclass(frozen=True)
class RemoteLag:
    """How far the remote may fall behind while unreachable before a save fails: `steps` saved
    steps not uploaded, or `seconds` since the oldest of them was saved (None: no limit, the
    default); `retry_after`: seconds before the first new attempt (doubling up to 10 min)."""

    steps: int | None = None
    seconds: float | None = None
    retry_after: float = 30.0

    def __post_init__(self) -> None:
        steps = self.steps
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
            raise StateError(f"RemoteLag(steps=) must be a non-negative int or None, got {self.steps!r}")
        for name in ("seconds", "retry_after"):
            value = getattr(self, name)
            if value is None and name == "seconds":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise StateError(f"RemoteLag({name}=) must be a non-negative number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RemoteLagReport:
    """Where the remote stands (`CheckpointManager.remote_lag`): the saved `steps` not uploaded
    (oldest first; empty when the remote is up to date), the `seconds` since the oldest of
    them was saved, and the last upload failure's message."""

    steps: tuple[int, ...] = ()
    seconds: float = 0.0
    error: str | None = None


def tolerated(exc: BaseException) -> bool:
    """Whether an upload failure is the remote's being unreachable (kept local, retried)."""
    return isinstance(exc, UploadError) and getattr(exc, "unreachable", False) and not isinstance(exc, RankLostError)


class LagState:
    """The steps not uploaded yet and when to try again; the same on every rank (its times
    count on rank 0 only, which decides)."""

    def __init__(self, limit: RemoteLag):
        self.limit = limit
        self.steps: list[int] = []
        self.since: float | None = None  # when the oldest step not uploaded was saved
        self.error: str | None = None
        self.failures = 0
        self.next_try = 0.0
        self.newest: int | None = None  # the step last left local
        self.newest_tried = False  # whether its upload was tried (False: skipped within the wait)

    def due(self, step: int) -> bool:
        """Rank 0: whether an upload of `step` is tried now: nothing lags, the wait after the
        last failure is over, or leaving `step` untried would already pass the limit."""
        now = time.monotonic()
        if not self.steps or now >= self.next_try:
            return True
        limit = self.limit
        lagging = len(set(self.steps) | {step})
        too_old = limit.seconds is not None and self.since is not None and now - self.since > limit.seconds
        return (limit.steps is not None and lagging > limit.steps) or too_old

    def left_local(self, step: int, exc: BaseException | None, *, backoff: bool = True) -> None:
        """`step` was not uploaded: its upload failed with `exc`, or was skipped (None);
        `backoff=False`: found unreachable without a try (a load), the next save tries."""
        if self.since is None:
            self.since = time.monotonic()
        if step not in self.steps:
            self.steps.append(step)
        self.newest, self.newest_tried = step, exc is not None
        if exc is not None:
            self.error = str(exc)
        if exc is not None and backoff:
            self.failures += 1
            delay = min(self.limit.retry_after * 2 ** (self.failures - 1), MAX_BACKOFF)
            self.next_try = time.monotonic() + delay

    def attempt(self, uri: str, step: int, upload, group=None, *, force: bool = False, final: str | None = None):
        """Collective: `upload()` unless the remote failed too recently (`force`: whatever the
        wait). A failure for want of the remote leaves `step` local: (None, the warning to
        give) until the lag passes the limit (`RemoteLagError`), or at once with `final` (the
        call that ends the job, e.g. "close()": no later save will try again); an upload that
        ran gives (its result, None)."""
        attempted, cause = True, None
        if self.steps and not force and not _dist.decide_on_rank0(lambda: self.due(step), group):
            attempted = False
        else:
            try:
                result = upload()
            except Exception as exc:
                if not tolerated(exc):
                    raise
                cause = exc
            else:
                self.uploaded()
                return result, None
        self.left_local(step, cause)
        if final is not None:
            raise RemoteLagError(self.unfinished(uri, step, final), path=uri) from cause
        why = _dist.decide_on_rank0(lambda: self.over(uri), group)
        if why is not None:
            raise RemoteLagError(why, path=uri) from cause
        return None, self.warning(uri, step, attempted)

    def uploaded(self) -> None:
        self.steps, self.since, self.error, self.failures, self.next_try = [], None, None, 0, 0.0
        self.newest, self.newest_tried = None, False

    def unfinished(self, remote: str, step: int, call: str) -> str:
        """The RemoteLagError's message when the upload of `step` that `call` made failed."""
        return (
            f"{remote}: step {step} is committed locally only: its upload at {call} failed and no later save will "
            f"try again ({len(self.steps)} step(s) not uploaded: {describe_steps(self.steps)}; last failure: "
            f"{self.error}); a job that resumes from the local roots uploads it"
        )

    def report(self) -> RemoteLagReport:
        seconds = 0.0 if self.since is None else time.monotonic() - self.since
        return RemoteLagReport(tuple(self.steps), seconds, self.error)

    def over(self, remote: str) -> str | None:
        """Rank 0: why the lag is past the limit (the RemoteLagError's message), or None."""
        limit, report = self.limit, self.report()
        if limit.steps is not None and len(report.steps) > limit.steps:
            why = f"{len(report.steps)} steps not uploaded, more than RemoteLag(steps={limit.steps}) allows"
        elif limit.seconds is not None and report.steps and report.seconds > limit.seconds:
            why = (
                f"the oldest step not uploaded was saved {report.seconds:.0f} s ago, more than "
                f"RemoteLag(seconds={limit.seconds:g}) allows"
            )
        else:
            return None
        return f"{remote}: {why} (steps {describe_steps(report.steps)}; last failure: {report.error})"

    def warning(self, remote: str, step: int, attempted: bool) -> str:
        """The RemoteUnavailableWarning after `step` was left local."""
        what = "could not be uploaded" if attempted else "is not uploaded (the remote failed recently)"
        return (
            f"{remote}: step {step} {what}; it stays local and committed, and the upload is tried again at a "
            f"later save, wait() or close(). {len(self.steps)} step(s) not uploaded yet "
            f"({describe_steps(self.steps)}); last failure: {self.error}"
        )


def describe_steps(steps) -> str:
    steps = list(steps)
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ... {steps[-1]}"


__all__ = ["MAX_BACKOFF", "LagState", "RemoteLag", "RemoteLagReport", "describe_steps", "tolerated"]
