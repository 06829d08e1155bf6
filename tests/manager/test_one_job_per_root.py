"""One job per root: a CheckpointManager takes its root's lock at its first load (or first
save, maybe_save or gc), before any training, and holds it until close(). A second job (another
process) gets LockedError naming the holder at that first call, on every rank; managers of one
process share the hold; `hold_lock=False` opts out (read-only use)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from ckptlib import CheckpointManager
from ckptlib.errors import CheckpointExistsError, LockedError
from ckptlib.manager.lock import LEASE_PREFIX, LOCK_NAME, StaleLockWarning


def _state(step: int) -> dict:
    return {"w": torch.arange(6, dtype=torch.float32) + step, "step": step}


# A second job: load, then (it must never get there while locked) train and save.
SECOND_JOB = r"""
import json, sys, torch
from ckptlib import CheckpointManager
from ckptlib.errors import LockedError
root, hold, close = sys.argv[1], sys.argv[2] == "hold", sys.argv[3] == "close"
mgr = CheckpointManager(root, hold_lock=hold)
state = {"w": torch.zeros(6), "step": 0}
try:
    step = mgr.load(state)
except LockedError as exc:
    print(json.dumps({"raised": "LockedError", "message": str(exc), "holder": exc.holder}))
    sys.exit(0)
out = {"loaded": step, "w": state["w"].tolist()}
if hold:
    after = (step or 0) + 1
    mgr.save(after, {"w": state["w"] + 1, "step": after})
    out["saved"] = after
    if close:
        mgr.close()  # else the lock goes at interpreter exit
print(json.dumps(out))
"""


def _second_job(root, hold: str = "hold", close: str = "close") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SECOND_JOB, str(root), hold, close], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _held_listing(root, token: str) -> list[str]:
    """The root's names but the holder's own lease file (written once it held the lock a quarter
    of its lease, 30 s: on a loaded machine a second job's start can take that long)."""
    return sorted(n for n in os.listdir(root) if n != LEASE_PREFIX + token)


def _holding_job(tmp_path):
    root = tmp_path / "run"
    first = CheckpointManager(root)
    first.save(1, _state(1))
    return root, first


def test_a_second_job_is_refused_at_its_first_load_naming_the_holder(tmp_path):
    root, first = _holding_job(tmp_path)
    holder = first.lock_holder()
    assert (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
    out, _ = _second_job(root)
    assert out == {
        "raised": "LockedError",
        "message": (
            f"{root} is locked by another writer: pid {os.getpid()} on host {socket.gethostname()}, since "
            f"{holder.created} (lock file {root}/{LOCK_NAME}). Two managers must not write one root at once. "
            f"If that writer is gone, remove the lock with CheckpointManager({str(root)!r}).break_lock() or "
            f"`ckpt unlock {root}`."
        ),
        "holder": holder.to_json(),
    }
    assert _held_listing(root, holder.token) == [LOCK_NAME, "latest", "step_0000000001"]  # it never saved
    first.close()


def test_the_lock_is_taken_at_the_first_load_before_any_save(tmp_path):
    root, first = _holding_job(tmp_path)
    first.close()
    mgr = CheckpointManager(root)
    assert mgr.load(_state(0)) == 1
    assert mgr.lock_holder().pid == os.getpid()  # held since the load, no save yet
    out, _ = _second_job(root)
    assert out["raised"] == "LockedError"
    mgr.close()
    assert not (root / LOCK_NAME).exists()


@pytest.mark.parametrize("call", ["maybe_save", "gc"])
def test_the_first_maybe_save_or_gc_takes_the_lock_of_a_manager_that_never_loads(tmp_path, call):
    root, first = _holding_job(tmp_path)
    first.close()
    mgr = CheckpointManager(root)
    if call == "maybe_save":
        assert mgr.maybe_save(2, _state(2)) is False  # no policy: nothing saved, the root held
    else:
        assert mgr.gc() == []
    assert mgr.lock_holder().pid == os.getpid()
    assert _second_job(root)[0]["raised"] == "LockedError"
    mgr.close()


def _second_job_ranks(root):
    mgr = CheckpointManager(root)
    state = _state(0)
    try:
        mgr.load(state)
    except LockedError as exc:
        return ("refused at load", str(exc))
    mgr.save(9, state)  # never reached
    return ("saved", None)


def test_every_rank_of_a_second_job_raises_at_its_first_load(tmp_path, dist_run):
    root, first = _holding_job(tmp_path)
    results = dist_run(2, _second_job_ranks, str(root), return_exceptions=True)
    assert [r[0] for r in results] == ["refused at load"] * 2, results
    assert len({r[1] for r in results}) == 1
    assert f"is locked by another writer: pid {os.getpid()} on host {socket.gethostname()}, since " in results[0][1]
    assert _held_listing(root, first.lock_holder().token) == [LOCK_NAME, "latest", "step_0000000001"]
    first.close()


def test_hold_lock_false_opts_out_for_read_only_use(tmp_path):
    root, first = _holding_job(tmp_path)
    out, _ = _second_job(root, "read-only")
    assert out == {"loaded": 1, "w": _state(1)["w"].tolist()}
    assert first.lock_holder().pid == os.getpid()
    first.close()


def test_managers_of_one_process_share_the_hold(tmp_path):
    root, first = _holding_job(tmp_path)
    second = CheckpointManager(root)
    state = _state(0)
    assert second.load(state) == 1
    token = first.lock_holder().token
    second.save(2, _state(2))
    first.save(3, _state(3))
    assert second.lock_holder().token == token  # one lock, shared
    first.close()
    assert second.lock_holder().token == token  # the last holder keeps it
    assert _second_job(root)[0]["raised"] == "LockedError"
    second.close()
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002", "step_0000000003"]


def test_after_close_another_job_takes_the_root(tmp_path):
    root, first = _holding_job(tmp_path)
    first.close()
    out, _ = _second_job(root)
    assert out == {"loaded": 1, "w": _state(1)["w"].tolist(), "saved": 2}
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002"]


def test_exit_releases_the_hold_for_a_relaunch(tmp_path):
    root = tmp_path / "run"
    out, stderr = _second_job(root, close="exit")  # a job that exits without close()
    assert out == {"loaded": None, "w": [0.0] * 6, "saved": 1}
    assert "nothing to resume (it does not exist)" in stderr  # the lock file does not hide that
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001"]  # the lock went at exit
    out, _ = _second_job(root, close="exit")  # the relaunch takes the root
    assert out == {"loaded": 1, "w": [1.0] * 6, "saved": 2}


CRASHED_HOLDER = r"""
import sys, time, torch
from ckptlib import CheckpointManager
mgr = CheckpointManager(sys.argv[1])
mgr.load({"w": torch.zeros(6), "step": 0})
print("holding", flush=True)
time.sleep(600)
"""


def test_a_crashed_holder_s_lock_is_stale_for_the_next_job(tmp_path):
    root, first = _holding_job(tmp_path)
    first.close()
    crashed = subprocess.Popen([sys.executable, "-c", CRASHED_HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert crashed.stdout.readline().strip() == "holding"
        dead_pid = crashed.pid
        assert json.loads((root / LOCK_NAME).read_text())["pid"] == dead_pid
    finally:
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(60)
        crashed.stdout.close()
    mgr = CheckpointManager(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load(_state(0)) == 1
    stale = [str(w.message) for w in caught if issubclass(w.category, StaleLockWarning)]
    assert len(stale) == 1 and f"removing a stale lock left by pid {dead_pid} on host" in stale[0]
    assert "that process no longer runs" in stale[0]
    assert mgr.lock_holder().pid == os.getpid()
    mgr.close()


def test_a_step_committed_by_another_job_is_never_advised_overwrite(tmp_path):
    root = tmp_path / "run"
    other = CheckpointManager(root, hold_lock=False)
    other.save(1, _state(1))  # another run's step, which `latest` names
    mgr = CheckpointManager(root, hold_lock=False)
    with pytest.raises(CheckpointExistsError) as info:
        mgr.save(1, _state(1))
    message = str(info.value)
    assert "overwrite=True" not in message
    assert message == (
        f"step 1 is already committed under {root}, by another job or an earlier run (this manager neither "
        f"saved it nor resumed from it): the root may be in use by another job (its lock is free now; list its "
        f"steps with `ckpt ls {root}`). Refusing to replace it: resume from it with load(), or save to another root"
    )
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001"]


def test_a_step_this_manager_saved_keeps_the_overwrite_hint(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    with pytest.raises(CheckpointExistsError, match=r"\(pass overwrite=True\)"):
        mgr.save(1, _state(1))
    mgr.save(1, _state(5), overwrite=True)
    mgr.close()


def _other_host_lock(root, age_s: float) -> dict:
    """The lock of a job on another host (its pid cannot be checked from here), taken `age_s`
    ago and never renewed since."""
    import datetime

    created = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=age_s)
    doc = {
        "format": "ckptlib-lock",
        "host": "elsewhere.example",
        "pid": 7,
        "start": "1",
        "token": "0" * 32,
        "created": created.isoformat(timespec="seconds"),
        "lease_s": 120.0,
    }
    (root / LOCK_NAME).write_text(json.dumps(doc))
    return doc


def test_a_relaunch_takes_over_a_lock_whose_lease_ran_out_on_another_host(tmp_path):
    """A node lost with the job (nothing renews its lease): the relaunch, anywhere, takes the
    lock over at its first load once the lease ran out, without anyone running `ckpt unlock`."""
    root, first = _holding_job(tmp_path)
    first.close()
    doc = _other_host_lock(root, age_s=600)
    mgr = CheckpointManager(root)
    with pytest.warns(StaleLockWarning) as caught:
        assert mgr.load(_state(0)) == 1
    (message,) = [str(w.message) for w in caught]
    idle = int(message.rsplit("last taken ", 1)[-1].split(" s ago")[0])
    assert 600 <= idle < 900  # 600 s, and what the test took
    assert message == (
        f"{root}: removing a stale lock left by pid 7 on host elsewhere.example, since {doc['created']} "
        f"(its 120 s lease expired: last taken {idle} s ago)"
    )
    assert mgr.lock_holder().pid == os.getpid()
    mgr.close()
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001"]


def test_a_relaunch_is_refused_while_another_host_s_job_renews_its_lease(tmp_path):
    """The old job still runs on another host (its lease is fresh): the relaunch gets
    LockedError naming it at its first load, and nothing of the root changes."""
    root, first = _holding_job(tmp_path)
    first.close()
    doc = _other_host_lock(root, age_s=0)
    before = (root / LOCK_NAME).read_bytes()
    mgr = CheckpointManager(root)
    with pytest.raises(LockedError) as info:
        mgr.load(_state(0))
    assert str(info.value) == (
        f"{root} is locked by another writer: pid 7 on host elsewhere.example, since {doc['created']} (lock file "
        f"{root}/{LOCK_NAME}). Two managers must not write one root at once. If that writer is gone, remove the "
        f"lock with CheckpointManager({str(root)!r}).break_lock() or `ckpt unlock {root}`."
    )
    assert (root / LOCK_NAME).read_bytes() == before
    assert sorted(os.listdir(root)) == [LOCK_NAME, "latest", "step_0000000001"]
