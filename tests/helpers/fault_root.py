"""The fault model's machine of one root (`SingleRootMachine`); see tests/helpers/fault_model.py.

A failing run prints the shrunk sequence as calls on `state = SingleRootMachine()`: run them in the
tests directory after `from helpers.fault_root import SingleRootMachine`."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import ckptlib
from ckptlib import AsyncMode, CheckpointError, CheckpointManager
from ckptlib.format.verify import verify
from ckptlib.testing.harness.crash_points import Watch, run_case
from helpers.fault_model import (
    CAP,
    KNOWN_OPEN,
    MODES,
    STEP,
    STEPS,
    RootModel,
    assert_state,
    bounded,
    call,
    crash_gc,
    crash_save,
    end,
    leftovers,
    lock_pid,
    observe,
    paused_holder,
    pausing_saver,
    state,
    step_names,
    template,
)

#: Write boundaries inside an act right after a lease check (the fence and the commit's manifest
#: write, its directory fsyncs, or the rename of `latest` are separate storage calls, with no
#: conditional write between them): a holder paused there is killed, not resumed (see
#: paused_mid_save); docs/integrity.md names the window. Left open in round five.
UNFENCED_WINDOW = ("rename latest", "fsync step_")


class SingleRootMachine(RuleBasedStateMachine):
    """One root, the jobs that write it, the faults that hit them; see the module docstring."""

    known_open = frozenset(KNOWN_OPEN)

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="ckptlib-fault-model-")
        self.root = os.path.join(self.tmp, "root")
        self.model: RootModel | None = None
        self.mgr: CheckpointManager | None = None
        self.mode = "sync"
        self.pending: tuple[int, int] | None = None  # the primary job's async save in flight
        self.other: CheckpointManager | None = None  # a second job on the same root
        self.versions = 0

    def _version(self) -> int:
        self.versions += 1
        return self.versions

    # -- the primary job --------------------------------------------------------------
    @initialize(mode=st.sampled_from(sorted(MODES)), keep_last=st.integers(1, 3))
    def start(self, mode: str, keep_last: int) -> None:
        """A job starts on an empty root: CheckpointManager(root, keep_last=, async_save=MODES[mode])."""
        self.model = RootModel(keep_last)
        self._open(mode)
        outcome, value, _ = call("load on an empty root", self.mgr.load, template())
        assert (outcome, value) == ("ok", None), f"a fresh root resumed {value!r}"

    def _open(self, mode: str) -> None:
        self.mode = mode
        # per-save locking (hold_lock=False, said explicitly): the model's other jobs and paused
        # holders take the root between its saves
        self.mgr = CheckpointManager(self.root, keep_last=self.model.keep_last, async_save=MODES[mode], hold_lock=False)

    def _settle(self, what: str) -> None:
        """The primary job's async save in flight is done: it committed (wait() returns its result)."""
        if self.pending is None:
            return
        step, version = self.pending
        self.pending = None
        outcome, value, _ = call(f"wait() for the async save of step {step}", self.mgr.wait)
        assert outcome == "ok", f"{what}: the async save of step {step} failed: {value!r}"
        self._check_result(value, step)
        self.model.commit(step, version)

    def _check_result(self, result, step: int) -> None:
        if result is None:  # delivered already (a save's own wait)
            return
        assert result.step == step, f"the save result names step {result.step}, not {step}"
        if MODES[self.mode] and MODES[self.mode].max_staging_bytes is not None:
            peak = result.staging_peak_bytes
            assert peak is not None and 0 < peak <= CAP, f"staged {peak} bytes under max_staging_bytes={CAP}"

    @rule(step=STEPS)
    def save(self, step: int) -> None:
        """mgr.save(step, state): refused for the step `latest` names, committed otherwise."""
        self._settle("save")
        version = self._version()
        outcome, value, caught = call(f"save({step})", self.mgr.save, step, state(step, version))
        if step == self.model.latest and self.model.latest in self.model.committed:
            if outcome == "ok" and MODES[self.mode]:  # an async save's failure is raised by the next wait()
                outcome, value, _ = call(f"wait() after save({step})", self.mgr.wait)
            assert outcome == "error" and isinstance(value, ckptlib.CheckpointExistsError), (
                f"saving step {step}, which latest names, gave {outcome} {value!r}"
            )
            return
        assert outcome == "ok", f"save({step}) raised {value!r}"
        if step in self.model.committed:
            assert any(issubclass(w.category, ckptlib.StalePointerWarning) for w in caught), (
                f"save({step}) replaced a committed step latest does not name without a StalePointerWarning"
            )
        if MODES[self.mode]:
            self.pending = (step, version)
        else:
            self._check_result(value, step)
            self.model.commit(step, version)

    @rule()
    def wait(self) -> None:
        """mgr.wait(): the async save in flight commits."""
        self._settle("wait")

    @rule()
    def load(self) -> None:
        """mgr.load(state): the newest committed step, bit-exactly."""
        self._settle("load")
        got = template()
        outcome, value, _ = call("load()", self.mgr.load, got)
        want = self.model.resumes()
        assert outcome == "ok" and value == want, f"load() gave {outcome} {value!r}, the model resumes {want}"
        if want is not None:
            assert_state(got, want, self.model.committed[want], "load()")

    @rule(step=STEPS)
    def rollback(self, step: int) -> None:
        """mgr.load(state, step=N): that step bit-exactly, or CheckpointNotFoundError."""
        self._settle("rollback")
        got = template()
        outcome, value, _ = call(f"load(step={step})", self.mgr.load, got, step=step)
        if step in self.model.committed:
            assert (outcome, value) == ("ok", step), f"load(step={step}) gave {outcome} {value!r}"
            assert_state(got, step, self.model.committed[step], f"load(step={step})")
        else:
            assert outcome == "error" and isinstance(value, ckptlib.CheckpointNotFoundError), (
                f"load(step={step}) of a step the root lacks gave {outcome} {value!r}"
            )

    @rule()
    def gc(self) -> None:
        """mgr.gc(dry_run=True) names what mgr.gc() then removes: retention's steps and debris."""
        self._settle("gc")
        want = self.model.gc_names(set())
        outcome, dry, _ = call("gc(dry_run=True)", self.mgr.gc, dry_run=True)
        assert outcome == "ok" and dry == want, f"gc(dry_run=True) gave {outcome} {dry!r}, the model {want}"
        outcome, done, _ = call("gc()", self.mgr.gc)
        assert outcome == "ok" and done == dry, f"gc() removed {done!r}, its dry run said {dry}"
        self.model.collect()

    @rule(mode=st.sampled_from(sorted(MODES)))
    def restart(self, mode: str) -> None:
        """The job stops (mgr.close()) and a new one starts on the root (another mode) and resumes."""
        self._close()
        self._open(mode)
        self.load()

    def _close(self) -> None:
        if self.mgr is None:
            return
        pending, self.pending = self.pending, None
        outcome, value, _ = call("close()", self.mgr.close)
        assert outcome == "ok", f"close() raised {value!r}"
        if pending is not None:  # close() waits for the save in flight: committed
            self.model.commit(*pending)
        self.mgr = None

    @rule(step=STEPS)
    def save_past_the_staging_cap(self, step: int) -> None:
        """A job with AsyncMode(max_staging_bytes=4096) saves a state whose largest tensor is
        8448 bytes: StagingCapError naming the tensor, rank 0 and the step's path, and nothing
        written to the root."""
        self._settle("save_past_the_staging_cap")
        names = step_names(self.root)
        mgr = CheckpointManager(
            self.root,
            keep_last=self.model.keep_last,
            async_save=AsyncMode("thread", max_staging_bytes=4096),
            hold_lock=False,
        )
        try:
            outcome, value, _ = call(f"a capped job's save({step})", mgr.save, step, state(step, self._version()))
            if outcome == "ok":  # raised by the background, if at all
                outcome, value, _ = call(f"a capped job's wait() after save({step})", mgr.wait)
        finally:
            with contextlib.suppress(CheckpointError):
                mgr.close()
        assert outcome == "error" and isinstance(value, ckptlib.StagingCapError), (outcome, value)
        text = str(value)
        assert text.startswith("tensor 'model.w' on rank 0 is 8448 bytes, more than AsyncMode(max_staging_bytes=4096)")
        assert text.endswith(f"nothing was written to {self.root}/{STEP(step)}"), text
        assert step_names(self.root) == names, (
            f"a refused save changed the root: {sorted(step_names(self.root) ^ names)}"
        )

    @rule(step=STEPS)
    def second_job_saves(self, step: int) -> None:
        """Another job on the same root saves (its own manager): LockedError while the primary's
        async save holds the lock, else the save commits like any other."""
        if self.other is None:
            self.other = CheckpointManager(self.root, keep_last=self.model.keep_last, hold_lock=False)
        version = self._version()
        outcome, value, caught = call(f"a second job's save({step})", self.other.save, step, state(step, version))
        if outcome == "error" and isinstance(value, ckptlib.LockedError):
            assert self.pending is not None, f"the second job's save({step}) found the root locked: {value}"
            return
        self._settle("a second job's save")  # it got the lock: the primary's save released it, committed
        if step == self.model.latest and step in self.model.committed:
            assert outcome == "error" and isinstance(value, ckptlib.CheckpointExistsError), (outcome, value)
            return
        assert outcome == "ok", f"a second job's save({step}) raised {value!r}"
        self.model.commit(step, version)

    # -- crashes ----------------------------------------------------------------------
    @rule(step=STEPS, at=st.integers(0, 40), how=st.sampled_from(["kill", "fail"]))
    def crash_save(self, step: int, at: int, how: str) -> None:
        """A job's save(step) is killed (SIGKILL) or fails (ENOSPC) at its `at`-th storage write
        boundary (when it has that many; else it completes)."""
        self._settle("crash_save")
        version = self._version()
        before = self.model.copy()
        with bounded(f"crash_save({step}, {at}, {how})"):
            outcome = run_case(
                lambda: crash_save(self.root, before.keep_last, step, version), Watch(local=self.root), how, at
            )
        refused = step == before.latest and step in before.committed
        self._check_crash_outcome(outcome, f"save({step}) {how} at boundary {at}")
        after = before.copy()
        after.commit(step, version)
        committed, incomplete, latest = observe(self.root)
        if outcome.status == "completed" and not refused:
            assert (committed, latest) == (set(after.committed), step), (
                f"a completed save({step}) left steps {sorted(committed)}, latest {latest}; the model "
                f"{sorted(after.committed)}, latest {step}"
            )
        # Each step: kept as it was, or (the step saved) replaced by this version, or removed by
        # the retention that follows the commit; nothing else.
        allowed = set(before.committed) | {step}
        must = set(before.committed) & set(after.committed) - {step}
        assert must <= committed <= allowed, (
            f"after save({step}) {how} at {at}: committed {sorted(committed)}; must hold {sorted(must)}, "
            f"may hold {sorted(allowed)}"
        )
        assert latest in {before.latest, step}, f"after save({step}) {how} at {at}: latest names {latest}"
        assert latest != step or step in committed, f"latest names step {step}, which is not committed"
        self._adopt(before, step, version, refused)

    def _adopt(self, before: RootModel, step: int, version: int, refused: bool) -> None:
        """The model follows the root after an interrupted save of (step, version): each step
        committed now holds what it held before, or that save's values."""
        committed, incomplete, latest = observe(self.root)
        versions = {}
        for s in committed:
            if s != step or refused:
                versions[s] = before.committed[s]
            elif s not in before.committed or self._holds_version(s, version):
                versions[s] = version  # committed by the interrupted save
            else:
                versions[s] = before.committed[s]  # stopped before it replaced the old one
        self.model.committed = versions
        self.model.latest = latest
        self.model.debris = incomplete
        self.model.leftovers = leftovers(self.root)

    def _holds_version(self, step: int, version: int) -> bool:
        """Whether committed `step` holds `version`'s values (a crash after its commit)."""
        got = template()
        ckptlib.load(os.path.join(self.root, STEP(step)), got)
        return torch.equal(got["model"]["w"], state(step, version)["model"]["w"])

    @rule(at=st.integers(0, 30), how=st.sampled_from(["kill", "fail"]))
    def crash_gc(self, at: int, how: str) -> None:
        """gc() is killed or fails at its `at`-th write boundary: each doomed step is gone or intact."""
        self._settle("crash_gc")
        before = self.model.copy()
        with bounded(f"crash_gc({at}, {how})"):
            outcome = run_case(lambda: crash_gc(self.root, before.keep_last), Watch(local=self.root), how, at)
        self._check_crash_outcome(outcome, f"gc() {how} at boundary {at}")
        committed, incomplete, latest = observe(self.root)
        after = before.copy()
        after.collect()
        assert set(after.committed) <= committed <= set(before.committed), (
            f"after gc() {how} at {at}: committed {sorted(committed)}, between {sorted(after.committed)} "
            f"and {sorted(before.committed)}"
        )
        assert latest == before.latest, f"gc() moved latest from {before.latest} to {latest}"
        if outcome.status == "completed":
            assert committed == set(after.committed) and not incomplete, (committed, incomplete)
        self.model.committed = {s: before.committed[s] for s in committed}
        self.model.debris = incomplete
        self.model.leftovers = leftovers(self.root)

    def _check_crash_outcome(self, outcome, what: str) -> None:
        assert outcome.status in ("completed", "raised", "killed"), f"{what}: the child {outcome.status}"
        if outcome.status == "raised":
            assert "CheckpointError" in " ".join(outcome.error_mro), (
                f"{what} raised {outcome.error_type} (not a CheckpointError): {outcome.error_message}\n"
                f"{outcome.error_traceback}"
            )
            assert outcome.error_path, f"{what} raised {outcome.error_type} naming no path: {outcome.error_message}"

    # -- a paused lock holder ---------------------------------------------------------
    @rule(first=STEPS, second=STEPS, third=STEPS)
    def held_lock_paused(self, first: int, second: int, third: int) -> None:
        """A job holding the lock between saves (hold_lock=True) saves `first`, is paused
        (SIGSTOP) past its 1 s lease; this job takes the lock over (StaleLockWarning) and saves
        `third`; the paused job resumes and saves `second`: LockedError, nothing changed."""
        self._settle("held_lock_paused")
        v1, v2 = self._version(), self._version()
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        args = (child, self.root, self.model.keep_last, (first, v1), (second, v2))
        proc = ctx.Process(target=paused_holder, args=args)
        proc.start()
        child.close()
        try:
            with bounded("the lock holder's save"):
                status, error = parent.recv()
            if first == self.model.latest and first in self.model.committed:
                assert (status, error.split(":")[0]) == ("held", "CheckpointExistsError"), (status, error)
            else:
                assert (status, error) == ("held", ""), f"the lock holder's save({first}) raised {error}"
                self.model.commit(first, v1)
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(1.5)  # past the 1 s lease: not renewed while stopped
            self.save(third)
            self._settle("the take-over save")
            before = self.model.copy()
            os.kill(proc.pid, signal.SIGCONT)
            parent.send("go")
            with bounded("the paused holder's save"):
                status, locked, message = parent.recv()
            assert status == "raised" and locked, (
                f"the paused holder's save({second}) after another job took its lock over: {status} {message}"
            )
            committed, _, latest = observe(self.root)
            assert (committed, latest) == (set(before.committed), before.latest), "the paused holder changed the root"
        finally:
            end(proc)

    @precondition(lambda self: "lock-lease-fencing" not in self.known_open)
    @rule(second=STEPS, third=STEPS, at=st.integers(0, 40))
    def paused_mid_save(self, second: int, third: int, at: int) -> None:
        """Another job's save(second) is paused (SIGSTOP) at its `at`-th write boundary, past its
        1 s lease; this job takes the lock over (StaleLockWarning) and saves `third`; the paused
        job resumes: whatever it does then (LockedError, or finishing what needs no lock), it
        changes no committed step and not `latest`."""
        self._settle("paused_mid_save")
        version = self._version()
        before = self.model.copy()
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=pausing_saver, args=(child, self.root, before.keep_last, second, version, at))
        proc.start()
        child.close()
        try:
            with bounded("the other job's save up to its pause"):
                first = parent.recv()
            refused = second == before.latest and second in before.committed
            if first[0] != "paused":  # it has fewer boundaries: an ordinary save by another job
                self._adopt(before, second, version, refused)
                return
            self._adopt(before, second, version, refused)  # what it did before it was paused
            holds = lock_pid(self.root) == proc.pid
            if holds and any(act in first[1] for act in UNFENCED_WINDOW):
                # paused between its last lease check and the act itself: the one window a lease
                # cannot close without conditional writes (docs/integrity.md); a holder that never
                # resumes is a crashed one, so it is killed here instead of resumed
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(30)
                time.sleep(1.5)  # past the 1 s lease
                self.save(third)
                self._settle("the take-over save")
                return
            time.sleep(1.5)  # past the 1 s lease: not renewed while stopped
            self.save(third)
            self._settle("the take-over save")
            after = self.model.copy()
            os.kill(proc.pid, signal.SIGCONT)
            with bounded("the paused job's save once resumed"):
                status, named, message = parent.recv()
            assert status == "ok" or named, (
                f"the paused save({second}) once resumed raised {message} (not a CheckpointError)"
            )
            if not holds:  # paused before it took the lock or after it let go: an ordinary later save
                refused = second == after.latest and second in after.committed
                self._adopt(after, second, version, refused)
                return
            committed, incomplete, latest = observe(self.root)
            assert (committed, latest) == (set(after.committed), after.latest), (
                f"the paused save({second}) (stopped at {first[1]}) resumed after another job took the lock over and "
                f"changed the root: committed {sorted(committed)}, latest {latest}; "
                f"the model {sorted(after.committed)}, latest {after.latest}"
            )
            if latest is not None:
                got = template()
                ckptlib.load(os.path.join(self.root, STEP(latest)), got)
                assert_state(got, latest, after.committed[latest], "latest after the paused job resumed")
            self.model.debris = incomplete
        finally:
            end(proc)

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def root_matches_the_model(self) -> None:
        if self.model is None:
            return
        committed, incomplete, latest = observe(self.root)
        model = self.model
        if self.pending is None:
            assert committed == set(model.committed), (
                f"committed steps {sorted(committed)}, the model {sorted(model.committed)}"
            )
            assert latest == model.latest, f"latest names {latest}, the model {model.latest}"
        else:  # the async save in flight may have committed, moved latest and applied retention
            step, version = self.pending
            after = model.copy()
            after.commit(step, version)
            must = set(model.committed) & set(after.committed) - {step}
            assert must <= committed <= set(model.committed) | {step}, (
                f"committed {sorted(committed)} while step {step} is saved: must {sorted(must)}"
            )
            assert latest in {model.latest, step}
        if latest is not None and latest in committed:
            problems = [p for p in verify(os.path.join(self.root, STEP(latest))) if p.is_error]
            assert not problems, f"latest names step {latest}, which does not verify: {problems}"

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                self._close()
            if self.other is not None:
                self.other.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


__all__ = ["SingleRootMachine"]
