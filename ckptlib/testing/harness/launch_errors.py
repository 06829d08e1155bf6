"""What a launch raises or returns when ranks fail: RankError (RankTimeout), RankFailure per rank,
RemoteError (a rank's exception, rebuilt here), RankExited, SkipLaunch."""

from __future__ import annotations

import dataclasses


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
    """A rank ended without returning a result: it died, or the launcher killed it.

    ``stack_dump`` is where the rank was (its threads' stacks when it was killed, or the
    traceback of the signal that killed it); the message ends with its last lines."""

    #: How many lines of the stack dump the message shows.
    SHOWN_LINES = 25

    def __init__(self, rank: int, exitcode: int | None, reason: str, stack_dump: str = ""):
        super().__init__(f"rank {rank} {reason}")
        self.rank = rank
        self.exitcode = exitcode
        self.reason = reason
        self.stack_dump = stack_dump

    def __str__(self) -> str:
        text = f"rank {self.rank} {self.reason}"
        lines = self.stack_dump.strip().splitlines()
        if lines:
            text += f"; where it was (last {min(len(lines), self.SHOWN_LINES)} lines of its stacks):\n"
            text += "\n".join(lines[-self.SHOWN_LINES :])
        return text

    def __reduce__(self):
        return (type(self), (self.rank, self.exitcode, self.reason, self.stack_dump))


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
