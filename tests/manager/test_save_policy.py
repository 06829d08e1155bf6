"""maybe_save: save-decision policies and preemption, in one process and on several ranks.

Axes: the policy (every N steps, every T seconds on rank 0's clock, the final step, their
combinations), force=, the preemption signal (which rank gets it, sync or async manager).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointManager, EveryNSeconds, EveryNSteps, FinalStep, Preemption, StateError
from ckptlib.manager import policies as save_policy
from ckptlib.manager.policies import AnySavePolicy, AtSteps, SaveContext


def _dirs(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_")) if os.path.isdir(root) else []


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(save_policy, "clock", fake)
    return fake


@pytest.mark.parametrize(
    "policy, saved",
    [
        (EveryNSteps(3), [3, 6, 9]),
        (FinalStep(10), [10]),
        (EveryNSteps(4) | FinalStep(10), [4, 8, 10]),
        (AtSteps(1, 5) | EveryNSteps(7), [1, 5, 7]),
        (EveryNSteps(5) | EveryNSteps(2), [2, 4, 5, 6, 8, 10]),
        (None, []),
    ],
    ids=["every3", "final10", "every4|final10", "at1,5|every7", "every5|every2", "none"],
)
def test_step_policies_save_exactly(tmp_path, policy, saved):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, save_policy=policy)
    did = [step for step in range(1, 11) if mgr.maybe_save(step, _state(step))]
    assert did == saved and _dirs(root) == saved
    assert mgr.latest() == (saved[-1] if saved else None) and not mgr.preempted


def test_every_n_seconds_on_the_managers_clock(tmp_path, clock):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, save_policy=EveryNSeconds(60))  # the clock starts when the manager is made
    elapsed = {1: 10, 2: 59.9, 3: 60, 4: 100, 5: 119.9, 6: 125, 7: 500}  # seconds since creation at each step
    saved = []
    for step, t in elapsed.items():
        clock.now = 1000.0 + t
        if mgr.maybe_save(step, _state(step)):
            saved.append(step)
    # 60 s after creation (step 3), 60 s after that (120 -> step 6), then step 7
    assert saved == [3, 6, 7] and _dirs(root) == [3, 6, 7]


def test_a_plain_save_restarts_the_interval(tmp_path, clock):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, save_policy=EveryNSeconds(30))
    clock.now += 25
    mgr.save(1, _state(1))
    clock.now += 29
    assert not mgr.maybe_save(2, _state(2))
    clock.now += 1
    assert mgr.maybe_save(3, _state(3))
    assert _dirs(root) == [1, 3]


def test_force_and_no_second_save_of_a_step(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, save_policy=EveryNSteps(2))
    assert mgr.maybe_save(1, _state(1), force=True)
    assert mgr.maybe_save(2, _state(2))
    assert not mgr.maybe_save(2, _state(2))  # already saved by this manager: no error, no second save
    assert not mgr.maybe_save(2, _state(2), force=True)
    assert _dirs(root) == [1, 2]
    resumed = CheckpointManager(root, save_policy=EveryNSteps(2))
    assert resumed.load(_state(0)) == 2
    assert not resumed.maybe_save(2, _state(2))  # the step it resumed from


def test_policy_validation():
    for bad in (
        lambda: EveryNSteps(0),
        lambda: EveryNSeconds(0),
        lambda: EveryNSeconds(float("inf")),
        lambda: FinalStep(0),
        lambda: AtSteps(-1),
        lambda: EveryNSteps(True),
    ):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        EveryNSteps(2) | object()
    with pytest.raises(StateError, match="save_policy must have should_save"):
        CheckpointManager("/tmp/never", save_policy=3)
    combo = EveryNSteps(2) | FinalStep(9) | EveryNSeconds(5)
    assert isinstance(combo, AnySavePolicy) and len(combo.policies) == 3
    ctx = SaveContext(step=9, now=10.0, last_save_time=7.0, last_save_step=8)
    assert combo.should_save(ctx) and not (EveryNSteps(2) | EveryNSeconds(5)).should_save(ctx)


def test_bad_step_is_refused(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", save_policy=EveryNSteps(1))
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(StateError, match="step must be a non-negative int"):
            mgr.maybe_save(bad, _state(0))


# ---------------------------------------------------------------- preemption, one process


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_preemption_signal_saves_at_the_next_maybe_save(tmp_path, sig, async_save):
    root = tmp_path / "run"
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    mgr = CheckpointManager(root, save_policy=EveryNSteps(5), async_save=async_save, preemption=True)
    try:
        for step in range(1, 4):
            assert not mgr.maybe_save(step, _state(step))
        os.kill(os.getpid(), sig)  # the process survives: the handler only records it
        assert _dirs(root) == [] and not mgr.preempted
        assert mgr.maybe_save(4, _state(4))
        assert mgr.preempted and mgr.preemption_signal == sig.name
        assert mgr._pending is None  # synchronous: nothing in flight
        assert _dirs(root) == [4] and mgr.latest() == 4
        got = _state(0)
        assert CheckpointManager(root).load(got) == 4 and torch.equal(got["w"], torch.full((4,), 4.0))
        assert mgr.maybe_save(5, _state(5)) and mgr.preempted  # the policy still applies afterwards
        mgr.wait()
        assert _dirs(root) == [4, 5]
    finally:
        mgr.close()
    assert {s: signal.getsignal(s) for s in before} == before


def test_preemption_chains_to_a_python_handler_and_restores_it(tmp_path):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        mine = signal.getsignal(signal.SIGTERM)
        with CheckpointManager(tmp_path / "run", preemption=Preemption(signals=[signal.SIGTERM])) as mgr:
            assert signal.getsignal(signal.SIGUSR1) is usr1 and signal.getsignal(signal.SIGTERM) is not mine
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == [signal.SIGTERM]
            assert mgr.maybe_save(7, _state(7)) and mgr.preempted
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_preemption_after_the_step_was_saved_does_not_save_it_again(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, save_policy=EveryNSteps(2), preemption=True) as mgr:
        assert mgr.maybe_save(2, _state(2))
        os.kill(os.getpid(), signal.SIGTERM)
        assert not mgr.maybe_save(2, _state(2)) and mgr.preempted
        assert _dirs(root) == [2]


def test_a_signal_is_handled_once(tmp_path):
    """The signal makes one save; later maybe_saves follow the policy again until another signal."""
    root = tmp_path / "run"
    with CheckpointManager(root, save_policy=EveryNSteps(10), preemption=True) as mgr:
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.maybe_save(4, _state(4)) and mgr.preempted
        assert [mgr.maybe_save(step, _state(step)) for step in (5, 6)] == [False, False]
        assert _dirs(root) == [4]
        os.kill(os.getpid(), signal.SIGUSR1)
        assert mgr.maybe_save(7, _state(7)) and mgr.preemption_signal == "SIGUSR1"
        assert _dirs(root) == [4, 7]


def test_async_maybe_save_waits_for_the_save_in_flight_only_after_a_signal(tmp_path, monkeypatch):
    """Without a signal a maybe_save that does not save returns at once, the async save still
    writing; after a signal it waits for that save even when the step needs no new save."""
    import contextlib
    import threading

    from ckptlib.storage.local import LocalStorage

    gate = threading.Event()
    real_writer = LocalStorage.open_writer

    @contextlib.contextmanager
    def held_writer(self, path):
        assert gate.wait(10), "the write was never let through"
        with real_writer(self, path) as stream:
            yield stream

    monkeypatch.setattr(LocalStorage, "open_writer", held_writer)
    root = tmp_path / "run"
    with CheckpointManager(root, save_policy=EveryNSteps(2), async_save=True, preemption=True) as mgr:
        assert mgr.maybe_save(2, _state(2))  # staged; the write is held back
        assert not mgr.maybe_save(3, _state(3))
        assert mgr._pending is not None and not mgr._pending.done() and mgr.latest() is None
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(0.2, gate.set).start()
        assert not mgr.maybe_save(2, _state(2))  # already saved: no second save, but waited for
        assert mgr._pending is None and mgr.latest() == 2 and mgr.preempted
    assert _dirs(root) == [2]


def test_preemption_needs_the_main_thread(tmp_path):
    import threading

    errors = []

    def make():
        try:
            CheckpointManager(tmp_path / "run", preemption=True)
        except StateError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert errors and "only in the main thread" in errors[0]


# ---------------------------------------------------------------- several ranks


def _rank_clocks_disagree(root: str) -> list[int]:
    """Rank 0's clock says 100 s passed at step 3 only; rank 1's says it at every step."""
    rank = dist.get_rank()
    times = {1: 10.0, 2: 50.0, 3: 100.0, 4: 120.0}
    fake = FakeClock(0.0)
    save_policy.clock = fake
    mgr = CheckpointManager(root, save_policy=EveryNSeconds(90))
    saved = []
    for step, t in times.items():
        fake.now = t if rank == 0 else 1e6 * step
        if mgr.maybe_save(step, {"w": torch.full((2,), float(step))}):
            saved.append(step)
    return saved


def test_time_policy_follows_rank0s_clock(tmp_path, dist_run):
    root = str(tmp_path / "run")
    assert dist_run(2, _rank_clocks_disagree, root) == [[3], [3]]
    assert _dirs(root) == [3]


def _preempt_one_rank(root: str, signalled_rank: int, at_step: int, async_save: bool):
    rank = dist.get_rank()
    mgr = CheckpointManager(
        root, save_policy=EveryNSteps(4), async_save=async_save, preemption=Preemption(signals=[signal.SIGTERM])
    )
    saved = []
    w = torch.zeros(3)
    step = 0
    for step in range(1, 20):
        w += step * (rank + 1)
        if rank == signalled_rank and step == at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if mgr.maybe_save(step, {"w": ckptlib.RankLocal(_Holder(w)), "step": step}):
            saved.append(step)
        if mgr.preempted:
            break
    mgr.close()
    static_code = mgr.preemption_exit_code()  # no elastic agent: the job ends, every rank 0
    os.environ.update(TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_RESTART_COUNT="1")  # an agent, restarts left
    elastic_code = mgr.preemption_exit_code()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "3"  # none left: a restart would fail the job
    spent_code = mgr.preemption_exit_code()
    codes = (static_code, elastic_code, spent_code)
    return saved, step, mgr.preempted, mgr.preemption_signal, mgr.preempted_here, codes


class _Holder:
    def __init__(self, t):
        self.t = t

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])


def _resume_rank_local(root: str):
    t = torch.zeros(3)
    state = {"w": ckptlib.RankLocal(_Holder(t)), "step": -1}
    step = CheckpointManager(root).load(state)
    return step, state["step"], t.tolist()


@pytest.mark.parametrize("signalled_rank", [0, 2], ids=["signal-rank0", "signal-rank2"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_signal_on_one_rank_makes_every_rank_save(tmp_path, dist_run, signalled_rank, async_save):
    """SIGTERM reaches one of 3 ranks at step 6: every rank saves step 6 (the policy saved 4),
    stops, and the checkpoint holds every rank's exact state at step 6."""
    root = str(tmp_path / "run")
    results = dist_run(3, _preempt_one_rank, root, signalled_rank, 6, async_save)
    expected_signal = "SIGTERM"
    for rank, (saved, stopped_at, preempted, sig, here, codes) in enumerate(results):
        assert saved == [4, 6] and stopped_at == 6 and preempted
        assert sig == expected_signal  # every rank knows which signal it was
        assert here == (rank == signalled_rank)
        # under an elastic agent with restarts left, a rank not signalled asks to be restarted
        assert codes == ((0, 0, 0) if rank == signalled_rank else (0, 75, 0)), (rank, codes)
    assert _dirs(root) == [4, 6] and os.readlink(os.path.join(root, "latest")) == "step_0000000006"
    resumed = dist_run(3, _resume_rank_local, root)
    total = sum(range(1, 7))
    assert resumed == [(6, 6, [float(total * (r + 1))] * 3) for r in range(3)]
