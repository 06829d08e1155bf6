"""A stateful fault model of `CheckpointManager` (tests/manager/test_fault_model.py): what the
machines share. `helpers.fault_root.SingleRootMachine` (one root) and
`helpers.fault_tier.TierMachine` (the cluster tier on one node, a directory remote) are
hypothesis `RuleBasedStateMachine`s: each rule is one thing a training job (or its operator,
a crash, an outage) does through ckptlib's public API, and after every rule the roots are
checked against a reference model (`RootModel` per root) of what the API promises:

* the step a load resumes is the newest committed one, bit-exactly what was saved there;
* no committed step disappears except by retention (after a save) or an explicit `gc()`;
* every `latest` (the root, the node's, the remote's) names a committed step that verifies;
* every call returns, or raises a `CheckpointError` naming its path (and rank), within its
  bound (a SIGALRM watchdog: a hang is a failure of the rule that hung, shrunk like any other);
* `gc(dry_run=True)` names exactly what `gc()` then removes;
* an async save with `AsyncMode(max_staging_bytes=N)` never holds more than N staged bytes.

Crashes are the crash harness's (`ckptlib.testing.harness.crash_points`): the save or gc runs
in a forked child that is killed (SIGKILL), fails (ENOSPC) or is paused (SIGSTOP, past its
lock's lease) at its k-th storage write boundary; whatever the child left must be one of the
states the model allows, and the model then follows the root.

A failing sequence is printed shrunk by hypothesis as calls on the machine (`state =
SingleRootMachine()`, `state.save(step=3)`, ...), which is its own reproduction: from tests/,
import the machine from its helper module and run the printed lines (or paste them into a
test, as tests/manager/test_fault_model.py does for the known-open defects).

`KNOWN_OPEN` names defects being fixed elsewhere: the rules and checks that find them are off
while their name is listed (tests/manager/test_fault_model.py runs each one's minimal sequence
and expects it to fail until the fix merges; then the name is removed here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import warnings

import torch
from hypothesis import strategies as st

import ckptlib
from ckptlib import AsyncMode, CheckpointError, CheckpointManager
from ckptlib.testing.harness.crash_points import LocalProbe, Plan

#: Defects other branches are fixing now: name -> what is wrong. A rule or check that finds one
#: is off while its name is here (see the module docstring); the lead empties this after merging.
#: Emptied in round five: lock-lease-fencing, tier-gc-dry-run, tier-close-uploads-skipped and
#: tier-remote-resave were fixed (their sequences: tests/manager/test_fault_model.py FIXED). A
#: holder paused between its last lease check and the rename of `latest` is the one window a
#: lease cannot close without conditional writes (fault_root.UNFENCED_WINDOW, docs/integrity.md).
KNOWN_OPEN: dict[str, str] = {}

#: Seconds any one call may take before the watchdog fails it as a hang (a small state on a
#: local disk: each takes well under a second, a process writer's first save a few).
BOUND_S = 120
STEPS = st.integers(min_value=1, max_value=9)
MODES = {
    "sync": False,
    "thread": AsyncMode("thread"),
    "process": AsyncMode("process"),
    "thread-capped": AsyncMode("thread", max_staging_bytes=9000),  # each tensor fits, the state does not
    "process-capped": AsyncMode("process", max_staging_bytes=9000),
}
CAP = 9000
STEP_RE = re.compile(r"^step_(\d{10})$")
STEP = "step_{:010d}".format


def state(step: int, version: int) -> dict:
    """What a job saves at `step`: values that differ for every (step, version)."""
    gen = torch.Generator().manual_seed(step * 1000 + version)
    return {
        "model": {"w": torch.randn(64, 33, generator=gen), "b": torch.randn(7, generator=gen)},
        "step": step,
    }


def template() -> dict:
    return {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(7)}, "step": -1}


def assert_state(got: dict, step: int, version: int, what: str) -> None:
    want = state(step, version)
    for key in ("w", "b"):
        assert torch.equal(got["model"][key], want["model"][key]), (
            f"{what}: model.{key} is not step {step} v{version}'s"
        )
    assert got["step"] == step, f"{what}: step entry {got['step']} != {step}"


# ---------------------------------------------------------------- bounds and errors


class Hang(AssertionError):
    """A call ran past its bound."""


class bounded:
    """A context in which the code must finish within BOUND_S seconds (SIGALRM, main thread)."""

    def __init__(self, what: str, seconds: int = BOUND_S):
        self.what, self.seconds = what, seconds

    def _alarm(self, signum, frame):
        raise Hang(f"{self.what} did not return within {self.seconds} s")

    def __enter__(self):
        self._previous = signal.signal(signal.SIGALRM, self._alarm)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self._previous)


def call(what: str, fn, *args, **kwargs):
    """("ok", value) or ("error", CheckpointError) of fn(*args): within its bound, warnings
    recorded (returned third); anything else it raises is a failure of the rule."""
    with bounded(what), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn(*args, **kwargs)
        except CheckpointError as exc:
            assert exc.path or exc.rank is not None or "rank" in str(exc), f"{what}: {exc!r} names no path or rank"
            return "error", exc, caught
        except Hang:
            raise
        except BaseException as exc:
            raise AssertionError(f"{what} raised {type(exc).__name__} (not a CheckpointError): {exc}") from exc
    return "ok", value, caught


# ---------------------------------------------------------------- the reference model


@dataclasses.dataclass
class RootModel:
    """What the root holds by the manager's contract: committed step -> version, the step
    `latest` names, incomplete step directories (a crashed save's debris)."""

    keep_last: int
    committed: dict[int, int] = dataclasses.field(default_factory=dict)
    latest: int | None = None
    debris: set[int] = dataclasses.field(default_factory=set)
    leftovers: set[str] = dataclasses.field(default_factory=set)  # a crashed deletion's `step_*.deleting-*`

    def resumes(self) -> int | None:
        """The step a load resumes: `latest`'s if committed, else the highest committed."""
        if self.latest in self.committed:
            return self.latest
        return max(self.committed) if self.committed else None

    def doomed(self, protect: set[int]) -> list[int]:
        """Committed steps retention removes: not among the keep_last highest, not `latest`'s, not protected."""
        keep = set(sorted(self.committed)[-self.keep_last :]) | protect
        if self.latest is not None:
            keep.add(self.latest)
        return sorted(s for s in self.committed if s not in keep)

    def gc_names(self, protect: set[int]) -> list[str]:
        steps = sorted([STEP(s) for s in self.doomed(protect)] + [STEP(s) for s in self.debris - protect])
        return steps + sorted(self.leftovers)

    def commit(self, step: int, version: int) -> None:
        """A save of `step` committed: `latest` moves to it, then retention (debris goes too)."""
        self.committed[step] = version
        self.latest = step
        for s in self.doomed({step}):
            del self.committed[s]
        self.debris.clear()
        self.leftovers.clear()

    def collect(self) -> None:
        for s in self.doomed(set()):
            del self.committed[s]
        self.debris.clear()
        self.leftovers.clear()

    def copy(self) -> "RootModel":
        return RootModel(self.keep_last, dict(self.committed), self.latest, set(self.debris), set(self.leftovers))


def observe(root: str) -> tuple[set[int], set[int], int | None]:
    """(committed steps, incomplete step directories, the step `latest` names) of the root, read
    from its files (a committed step has its manifest)."""
    committed, incomplete = set(), set()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = STEP_RE.match(name)
        if m is None:
            continue
        if os.path.exists(os.path.join(root, name, "ckptlib.json")):
            committed.add(int(m.group(1)))
        else:
            incomplete.add(int(m.group(1)))
    link = os.path.join(root, "latest")
    try:
        pointer = os.readlink(link)  # read beside ckptlib (a remote "down" in the model is down for ckptlib only)
    except FileNotFoundError:
        pointer = None
    except OSError:
        with open(link, encoding="utf-8") as f:
            pointer = f.read().strip()
    m = STEP_RE.match(pointer or "")
    return committed, incomplete, (int(m.group(1)) if m else None)


def step_names(root: str) -> set[str]:
    """The step directories in the root, committed or not, and a crashed deletion's leftovers."""
    return {n for n in os.listdir(root) if n.startswith("step_")} if os.path.isdir(root) else set()


def leftovers(root: str) -> set[str]:
    """What a crashed deletion left in the root (`step_*.deleting-*`), for gc to remove."""
    return {name for name in os.listdir(root) if ".deleting-" in name} if os.path.isdir(root) else set()


# ---------------------------------------------------------------- children of crashes and pauses


def crash_save(root: str, keep_last: int, step: int, version: int):
    CheckpointManager(root, keep_last=keep_last, hold_lock=False).save(step, state(step, version))


def crash_gc(root: str, keep_last: int):
    return len(CheckpointManager(root, keep_last=keep_last, hold_lock=False).gc())


def paused_holder(conn, root: str, keep_last: int, first: tuple[int, int], second: tuple[int, int]) -> None:
    """A job that holds the root's lock (hold_lock=True, a 1 s lease), saves `first`, is paused
    by its parent, then saves `second` when told; reports what that save did."""
    try:
        os.environ["CKPTLIB_LOCK_LEASE_S"] = "1"
        mgr = CheckpointManager(root, keep_last=keep_last, hold_lock=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                mgr.save(first[0], state(*first))
                conn.send(("held", ""))
            except CheckpointError as exc:  # refused (the step latest names): it holds the lock all the same
                conn.send(("held", f"{type(exc).__name__}: {exc}"))
            conn.recv()
            try:
                mgr.save(second[0], state(*second))
                conn.send(("ok", False, ""))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which judges it
                conn.send(("raised", isinstance(exc, ckptlib.LockedError), f"{type(exc).__name__}: {exc}"))
            with contextlib.suppress(BaseException):
                mgr.close()
    finally:
        conn.close()
        os._exit(0)


class _PausePlan(Plan):
    """Counts boundaries like a recording run and, at boundary `pause_at`, reports it and stops
    the process (SIGSTOP) before the call runs: a holder paused mid-operation."""

    def __init__(self, pause_at: int, report):
        super().__init__("record", None, report)
        self.pause_at = pause_at

    def hit(self, backend: str, kind: str, path: str) -> bool:
        before = len(self.seen)
        super().hit(backend, kind, path)
        if before == self.pause_at and len(self.seen) == before + 1:
            self._report(self.seen[-1])
            os.kill(os.getpid(), signal.SIGSTOP)
        return False


def pausing_saver(conn, root: str, keep_last: int, step: int, version: int, at: int) -> None:
    """Another job's save of (step, version) with a 1 s lease, paused at write boundary `at`;
    reports ("paused", boundary) there, then what the save did."""
    try:
        os.environ["CKPTLIB_LOCK_LEASE_S"] = "1"
        LocalProbe(root, _PausePlan(at, lambda b: conn.send(("paused", b.label())))).install()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                CheckpointManager(root, keep_last=keep_last, hold_lock=False).save(step, state(step, version))
                conn.send(("ok", False, ""))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which judges it
                conn.send(("raised", isinstance(exc, CheckpointError), f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()
        os._exit(0)


def lock_pid(root: str) -> int | None:
    """The pid the root's lock file names, None without a lock."""
    try:
        with open(os.path.join(root, "ckptlib.lock"), encoding="utf-8") as f:
            return json.load(f).get("pid")
    except (OSError, ValueError):
        return None


def end(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()


__all__ = [
    "BOUND_S",
    "CAP",
    "KNOWN_OPEN",
    "MODES",
    "STEP",
    "STEPS",
    "RootModel",
    "assert_state",
    "bounded",
    "call",
    "crash_gc",
    "crash_save",
    "end",
    "leftovers",
    "lock_pid",
    "observe",
    "paused_holder",
    "pausing_saver",
    "state",
    "step_names",
    "template",
]
