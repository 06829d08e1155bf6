"""Preemption: remember that a termination signal arrived, so the training loop can save.

The handler only records the signal number (no I/O, no collective, no lock: it may run in
the middle of anything); `CheckpointManager.maybe_save` reads the flag and shares it with
every rank in its one collective, so a signal that reached a single rank still makes all
ranks save the same step.

Several watchers (several managers) share one handler per signal, a `_Chain`: it records the
signal for every open watcher, then calls the handler that was installed before it (from
Python), on every signal, so a second signal before the manager acts still reaches it. Closing
the watchers in any order puts back exactly the handler that was there before the first; a
chain that a later handler still calls (someone installed theirs on top of ours) keeps doing
what the handler before it did, the default action included, so no close order leaves a
process that ignores SIGTERM.

Under torchrun's elastic agent a preempted host's agent forwards the signal to its own workers
only: every rank saves the step reached, the signalled ranks exit 0 and the others exit with
`RESTART_EXIT_CODE` (`exit_code_after_preemption`), so their agents restart them at the
smaller world size instead of ending the job (docs/tier.md, "Under torchrun's elastic agent").
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from typing import Any, Iterable

from ckptlib.errors import StateError, stacklevel_outside_ckptlib

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: The exit status of a rank that saved because *another* host was preempted, under torchrun's
#: elastic agent with restarts left (EX_TEMPFAIL): its agent restarts it at the new world size.
RESTART_EXIT_CODE = 75


def exit_code_after_preemption(signalled_here: bool, env=None) -> int:
    """0 when this rank was signalled itself, or when no elastic agent will restart it (a
    static launch, or no restarts left: the job ends and is relaunched); else
    `RESTART_EXIT_CODE`, so the surviving hosts' agents restart their workers without the
    preempted one (a 0 would end the job on those hosts)."""
    env = os.environ if env is None else env
    if signalled_here:
        return 0
    try:
        restarts_left = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0
    return RESTART_EXIT_CODE if restarts_left > 0 else 0


class SharedAgentStoreWarning(UserWarning):
    """This worker's default process group uses the store of torchrun's agent, which outlives
    the workers; with restarts allowed, restarted workers can read the previous attempt's gloo
    addresses from it (`check_agent_store`)."""


_agent_store_warned = False


def check_agent_store(env=None) -> bool:
    """Warn (once per process, `SharedAgentStoreWarning`) when torchrun's agent shares its store
    with the workers (TORCHELASTIC_USE_AGENT_STORE=True: the c10d rendezvous by default, or a
    static one) and may restart them (TORCHELASTIC_MAX_RESTARTS > 0). torch keys a gloo group's
    addresses by rank only, and that store keeps them from one attempt to the next: a restarted
    rank that reads its peer's key before the peer rewrote it dials a process that is gone
    (`Gloo connectFullMesh failed ... Connection refused`) and every such attempt spends a
    restart (tests/helpers/agent_store_repro.py reproduces it without ckptlib). Returns whether
    this configuration was found."""
    global _agent_store_warned
    env = os.environ if env is None else env
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts <= 0:
        return False
    if not _agent_store_warned:
        _agent_store_warned = True
        warnings.warn(
            f"torchrun's agent shares its store with the workers (TORCHELASTIC_USE_AGENT_STORE=True) and may "
            f"restart them (--max-restarts {restarts}): restarted workers can read the previous attempt's gloo "
            "addresses from it and fail in init_process_group ('Gloo connectFullMesh failed ... Connection "
            "refused'), spending restarts. With the c10d rendezvous set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on "
            "every agent (a fresh store each round); docs/tier.md",
            SharedAgentStoreWarning,
            stacklevel=stacklevel_outside_ckptlib(),
        )
    return True


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _Chain:
    """The handler of one signal while watchers watch it: records the signal for each of them,
    then hands it to the handler installed before (`previous`)."""

    def __init__(self, sig: signal.Signals, previous: Any):
        self.sig = sig
        self.previous = previous
        self.watchers: list[PreemptionWatcher] = []

    def __call__(self, signum: int, frame: Any) -> None:
        for watcher in list(self.watchers):
            watcher._handle(signum, frame)
        previous = self.previous
        if self.watchers:
            # Chain to a handler installed from Python; never to the default action (which would
            # end the process before the save) nor to the KeyboardInterrupt raiser.
            if callable(previous) and previous is not signal.default_int_handler:
                previous(signum, frame)
            return
        # Nobody watches any more, yet a handler installed after ours still calls us: do what
        # the handler before us would have done.
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            current = signal.signal(self.sig, signal.SIG_DFL)
            try:
                signal.raise_signal(self.sig)  # the default action: most often, the end of the process
            finally:
                signal.signal(self.sig, current)


# The chain each signal's newest watcher joins (while it is still the installed handler).
_CHAINS: dict[signal.Signals, _Chain] = {}


def _join(sig: signal.Signals, watcher: "PreemptionWatcher") -> _Chain:
    chain = _CHAINS.get(sig)
    if chain is None or signal.getsignal(sig) is not chain:
        chain = _Chain(sig, signal.getsignal(sig))
        signal.signal(sig, chain)
        _CHAINS[sig] = chain
    chain.watchers.append(watcher)
    return chain


def _leave(chain: _Chain, watcher: "PreemptionWatcher") -> None:
    if watcher in chain.watchers:
        chain.watchers.remove(watcher)
    if chain.watchers:
        return
    if _CHAINS.get(chain.sig) is chain:
        del _CHAINS[chain.sig]
    if threading.current_thread() is threading.main_thread() and signal.getsignal(chain.sig) is chain:
        signal.signal(chain.sig, chain.previous if chain.previous is not None else signal.SIG_DFL)


class PreemptionWatcher:
    """Records the first of `signals` that arrives (`received`) until `close()`."""

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
        self.seen: int | None = None  # the first signal this process received (kept once handled)
        self._chains: list[_Chain] = []
        try:
            for sig in self.signals:
                self._chains.append(_join(sig, self))
        except BaseException:
            self.close()
            raise

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if self.seen is None:
            self.seen = signum

    def close(self) -> None:
        """Stop watching; once no watcher is left, the handlers that were there before return.
        One installed outside Python (faulthandler's) cannot be reinstalled from Python: the
        default action returns."""
        chains, self._chains = self._chains, []
        for chain in reversed(chains):
            _leave(chain, self)


__all__ = ["DEFAULT_SIGNALS", "RESTART_EXIT_CODE", "PreemptionWatcher", "exit_code_after_preemption", "signal_name"]
