"""Preemption: remember that a termination signal arrived, so the training loop can save.

The handler only records the signal number (no I/O, no collective, no lock: it may run in
the middle of anything); `CheckpointManager.maybe_save` reads the flag and shares it with
every rank in its one collective, so a signal that reached a single rank still makes all
ranks save the same step. Handlers that were installed before (from Python) are called
after ours; `close()` puts them back.
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Iterable

from .errors import StateError

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionWatcher:
    """Installs a flag-setting handler for `signals` until `close()`."""

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS):
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise StateError("preemption_signals must name at least one signal")
        if threading.current_thread() is not threading.main_thread():
            raise StateError(
                "save_on_preemption=True installs signal handlers, which Python allows only in the main "
                "thread; create the CheckpointManager there"
            )
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}
        try:
            for sig in self.signals:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        except BaseException:
            self.close()
            raise

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        previous = self._previous.get(signal.Signals(signum))
        # Chain to a handler installed from Python; never to the default action (which would
        # end the process before the save) nor to the KeyboardInterrupt raiser.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def close(self) -> None:
        """Put back the handlers that were there before. One installed outside Python
        (faulthandler's) cannot be reinstalled from Python: the default action returns."""
        for sig, previous in reversed(list(self._previous.items())):
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


__all__ = ["DEFAULT_SIGNALS", "PreemptionWatcher", "signal_name"]
