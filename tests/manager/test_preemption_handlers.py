"""save_on_preemption's signal handlers when several managers (watchers) come and go: closing
them in any order puts back exactly the handler that was there before, never leaves one that
only records (a process that then ignores SIGTERM); every handler installed before is called
for every signal, a second signal that arrives before the manager acts included, in the order
the signals came.

Before: each watcher saved the handler it replaced and restored it only if it was still the
installed one, so two managers closed in creation order left the first one's handler installed
with nothing to chain to, and SIGTERM no longer ended the process.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from ckptlib import CheckpointManager
from ckptlib.manager.preemption import PreemptionWatcher

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture
def user_handler():
    """A Python handler for SIGTERM and SIGUSR1 installed before any watcher; its calls."""
    calls: list[int] = []

    def handler(signum, frame):
        calls.append(signum)

    before = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield handler, calls
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=lambda o: "close" + "".join(map(str, o)))
def test_watchers_closed_in_any_order_put_back_the_handler_before(user_handler, order):
    handler, calls = user_handler
    watchers = [PreemptionWatcher(SIGNALS) for _ in range(3)]
    open_ = set(range(3))
    try:
        for k, closing in enumerate(order):
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == [signal.SIGTERM] * (k + 1)  # the user's handler, once per signal
            for i, watcher in enumerate(watchers):
                assert watcher.received == (signal.SIGTERM if i in open_ else None), (k, i)
                watcher.received = None
            watchers[closing].close()
            open_.discard(closing)
    finally:
        for watcher in watchers:
            watcher.close()
    assert all(signal.getsignal(sig) is handler for sig in SIGNALS)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert calls[-1] == signal.SIGUSR1 and all(w.received is None for w in watchers)


@pytest.mark.parametrize("order", list(itertools.permutations(range(2))), ids=lambda o: "close" + "".join(map(str, o)))
def test_the_default_action_comes_back_in_any_close_order(order):
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in SIGNALS}
    try:
        watchers = [PreemptionWatcher(SIGNALS) for _ in range(2)]
        for i in order:
            watchers[i].close()
        assert all(signal.getsignal(sig) == signal.SIG_DFL for sig in SIGNALS)
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


def test_a_second_signal_before_the_manager_acts_reaches_every_handler_in_order(tmp_path, user_handler):
    """Two signals arrive before maybe_save runs: the handler installed before is called for
    each, in order; the managers save once, naming the first signal."""
    _, calls = user_handler
    with CheckpointManager(tmp_path / "a", preemption=True) as first:
        with CheckpointManager(tmp_path / "b", preemption=True) as second:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == [signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM]
            for mgr in (first, second):
                assert mgr.maybe_save(3, {"w": torch.ones(2)}) and mgr.preemption_signal == "SIGTERM"
                assert not mgr.maybe_save(4, {"w": torch.ones(2)})  # handled: no save without a new signal
                assert mgr.steps() == [3]


def test_a_handler_installed_on_top_keeps_reaching_the_one_before(user_handler):
    """A handler installed after the watcher that chains to it: once the watcher is closed it
    stays installed (ckptlib does not remove what it did not install), and calling on still
    reaches the handler that was there before the watcher."""
    handler, calls = user_handler
    watcher = PreemptionWatcher([signal.SIGTERM])
    ours = signal.getsignal(signal.SIGTERM)
    on_top_calls = []

    def on_top(signum, frame):
        on_top_calls.append(signum)
        ours(signum, frame)

    signal.signal(signal.SIGTERM, on_top)
    watcher.close()
    assert signal.getsignal(signal.SIGTERM) is on_top
    os.kill(os.getpid(), signal.SIGTERM)
    assert on_top_calls == [signal.SIGTERM] and calls == [signal.SIGTERM] and watcher.received is None


_SCRIPT = """
import os, signal, sys, time
from ckptlib import CheckpointManager
from ckptlib.manager.preemption import PreemptionWatcher
case = sys.argv[1]
if case == "managers":
    first = CheckpointManager(sys.argv[2] + "/a", preemption=True)
    second = CheckpointManager(sys.argv[2] + "/b", preemption=True)
    first.close()
    second.close()
else:  # a handler on top that chains to the closed watcher, whose handler before was the default
    watcher = PreemptionWatcher([signal.SIGTERM])
    ours = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: ours(signum, frame))
    watcher.close()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("still alive after SIGTERM")
"""


@pytest.mark.parametrize("case", ["managers", "chained-on-top"])
def test_sigterm_still_ends_the_process_after_the_managers_close(tmp_path, case):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), case, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "still alive" not in done.stdout
