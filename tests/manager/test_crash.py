"""Crash consistency and the writer lock.

A rank SIGKILLs itself at each boundary of `CheckpointManager.save` (storage methods are
patched in that rank's process only). Afterwards the previous step still loads bit-exactly,
`latest` never names an incomplete checkpoint, the root is not left locked, and the next save
removes the debris (exact directory listings). Like torchsnapshot's faulty storage plugin and
Megatron's injected worker exits, but with a real SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointManager, LockedError
from ckptlib._runtime.agree import ROLL_CALL_SECONDS
from ckptlib.format import classify
from ckptlib.format.verify import verify
from ckptlib.manager.lock import LOCK_NAME, StaleLockWarning, _process_start
from ckptlib.storage import open_storage
from ckptlib.testing import RankExited


def _full(step: int) -> torch.Tensor:
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(step))


def _bias(step: int) -> torch.Tensor:
    return torch.randn(3, generator=torch.Generator().manual_seed(1000 + step))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    """Patch this process's LocalStorage so that it SIGKILLs itself at `point`."""
    from ckptlib.storage.local import LocalStorage

    when, what = point.split("-", 1)
    if what == "shard":
        orig_writer = LocalStorage.open_writer

        @contextlib.contextmanager
        def open_writer(self, path):
            with orig_writer(self, path) as stream:
                if when == "mid":
                    stream.write(b"\0" * 64)
                    stream.flush()
                    _die()
                yield stream
            _die()  # "after": the shard file is complete and fsynced

        LocalStorage.open_writer = open_writer
    elif what == "metadata":  # the coordinator streams `.metadata` into its file
        orig_writer = LocalStorage.open_writer

        @contextlib.contextmanager
        def open_writer(self, path):
            if path == ".metadata" and when == "before":
                _die()
            with orig_writer(self, path) as stream:
                if path == ".metadata" and when == "mid":
                    stream.write(b"\x80\x04")  # a torn pickle
                    stream.flush()
                    _die()
                yield stream
            if path == ".metadata" and when == "after":
                _die()

        LocalStorage.open_writer = open_writer
    elif what == "manifest":
        orig_write = LocalStorage.write

        def write(self, path, data, **kwargs):
            if path == "ckptlib.json" and when == "before":
                _die()
            orig_write(self, path, data, **kwargs)
            if path == "ckptlib.json" and when == "after":
                _die()

        LocalStorage.write = write
    elif what == "pointer":
        orig_pointer = LocalStorage.set_pointer

        def set_pointer(self, name, target):
            if when == "before":
                _die()
            orig_pointer(self, name, target)
            _die()

        LocalStorage.set_pointer = set_pointer
    elif what == "retention":
        import shutil

        shutil.rmtree = lambda *a, **k: _die()  # delete_tree renamed the old step, then dies
    else:
        raise ValueError(point)


def _crash_run(root: str, point: str, victim: int, keep_last):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def state(step):
        return {"w": distribute_tensor(_full(step), mesh, [Shard(0)]), "b": _bias(step), "step": step}

    mgr = CheckpointManager(root, keep_last=keep_last)
    mgr.save(1, state(1))
    if dist.get_rank() == victim:
        _arm(point)
    mgr.save(2, state(2))
    return "survived"


def _load_single(mgr: CheckpointManager, step=None):
    state = {"w": torch.zeros(6, 5), "b": torch.zeros(3), "step": -1}
    got = mgr.load(state, step)
    return got, state


def _assert_exact(state, step):
    assert state["step"] == step
    assert torch.equal(state["w"], _full(step)) and torch.equal(state["b"], _bias(step))


# (point, victim rank, step 2 committed?, latest afterwards, keep_last)
#: The whole launch's bound in the load-loss test (the survivor fails long before it).
LOAD_TIMEOUT = 120.0

CRASHES = [
    ("mid-shard", 1, False, 1, None),
    ("after-shard", 1, False, 1, None),
    ("after-shard", 0, False, 1, None),
    ("before-metadata", 0, False, 1, None),
    ("mid-metadata", 0, False, 1, None),
    ("after-metadata", 0, False, 1, None),
    ("before-manifest", 0, False, 1, None),
    ("after-manifest", 0, True, 1, None),
    ("before-pointer", 0, True, 1, None),
    ("after-pointer", 0, True, 2, None),
    ("during-retention", 0, True, 2, 1),
]


@pytest.mark.parametrize(
    "point, victim, committed, latest, keep_last",
    [pytest.param(*case, id=f"kill-rank{case[1]}-{case[0]}") for case in CRASHES],
)
def test_kill_during_save(tmp_path, dist_run, point, victim, committed, latest, keep_last):
    root = tmp_path / "run"
    results = dist_run(2, _crash_run, str(root), point, victim, keep_last, return_exceptions=True, grace=10)
    assert isinstance(results[victim], RankExited) and results[victim].exitcode == -signal.SIGKILL
    survivor = results[1 - victim]
    assert isinstance(survivor, Exception), f"the surviving rank finished: {survivor!r}"
    assert not isinstance(survivor, RankExited), f"the surviving rank hung until killed: {survivor!r}"

    step2 = root / "step_0000000002"
    assert (classify(open_storage(str(step2))) == "committed") is committed
    mgr = CheckpointManager(root, keep_last=keep_last)
    assert mgr.latest() == latest  # never an incomplete step
    got, state = _load_single(mgr)
    assert got == latest
    _assert_exact(state, latest)
    if point != "during-retention":
        _assert_exact(_load_single(mgr, 1)[1], 1)
    assert not [p for p in verify(mgr.path(latest)) if p.is_error]

    listing = sorted(os.listdir(root))
    if point == "during-retention":  # the old step was renamed away, not yet removed
        assert [n for n in listing if n.startswith("step_0000000001")][0].startswith("step_0000000001.deleting-")
    elif point == "after-manifest":  # committed, but the pending marker was never removed
        assert "ckptlib.pending" in os.listdir(step2)
    elif not committed and victim == 0:
        assert "step_0000000002" in listing  # the coordinator died: debris for the next save to clean
    elif not committed:
        # The surviving coordinator removed the failed save's files (rank 1's partial shard too).
        assert "step_0000000002" not in listing
    lock_left = LOCK_NAME in listing
    if victim == 0:
        assert lock_left  # the holder died with it; the next save must see it is stale
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.save(3, {"w": _full(3), "b": _bias(3), "step": 3})
    assert any(issubclass(w.category, StaleLockWarning) for w in caught) is lock_left

    if keep_last == 1:
        expected = ["latest", "step_0000000003"]
    elif committed:
        expected = ["latest", "step_0000000001", "step_0000000002", "step_0000000003"]
    else:
        expected = ["latest", "step_0000000001", "step_0000000003"]
    assert sorted(os.listdir(root)) == expected
    if committed and keep_last is None:
        assert sorted(os.listdir(step2)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "ckptlib.json"]
        _assert_exact(_load_single(mgr, 2)[1], 2)
    assert mgr.latest() == 3


def _load_and_die(uri: str, victim: int):
    if dist.get_rank() == victim:  # dies where it would read (or, read once, receive) its items
        from ckptlib.format.read.dcp_reader import CkptReader

        def read_data(self, plan, planner):
            _die()

        CkptReader.read_data = read_data
    start = time.monotonic()
    try:
        ckptlib.load(uri, {"w": torch.zeros(6, 5), "b": torch.zeros(3), "step": -1})
    except Exception as exc:
        exc.seconds = time.monotonic() - start
        raise
    return "loaded"


def test_rank_dying_during_load_fails_the_others(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    ckptlib.save(uri, {"w": _full(1), "b": _bias(1), "step": 1})
    start = time.monotonic()
    results = dist_run(2, _load_and_die, uri, 1, return_exceptions=True, timeout=LOAD_TIMEOUT)
    elapsed = time.monotonic() - start
    assert isinstance(results[1], RankExited) and results[1].exitcode == -signal.SIGKILL
    assert isinstance(results[0], Exception) and not isinstance(results[0], RankExited), results[0]
    # failed on its own, by the rank-loss guard: its roll call waits ROLL_CALL_SECONDS for the
    # dead rank; 5x that is the margin a loaded machine gets (a hang would run to the timeout)
    assert results[0].seconds < 5 * ROLL_CALL_SECONDS and elapsed < LOAD_TIMEOUT, (results[0].seconds, elapsed)


# ---------------------------------------------------------------- the lock


def test_second_concurrent_writer_gets_locked_error(tmp_path, monkeypatch):
    from ckptlib.storage.local import LocalStorage

    root = tmp_path / "run"
    writing, proceed = threading.Event(), threading.Event()
    orig_writer = LocalStorage.open_writer

    @contextlib.contextmanager
    def slow_writer(self, path):
        writing.set()
        assert proceed.wait(30)
        with orig_writer(self, path) as stream:
            yield stream

    monkeypatch.setattr(LocalStorage, "open_writer", slow_writer)
    first, second = CheckpointManager(root), CheckpointManager(root)
    errors = []

    def save_first():
        try:
            first.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=save_first)
    thread.start()
    try:
        assert writing.wait(30)
        with pytest.raises(LockedError) as info:
            second.save(2, {"w": _full(2), "b": _bias(2), "step": 2})
        with pytest.raises(LockedError):
            second.gc()
    finally:
        proceed.set()
        thread.join(30)
    assert not errors
    message = str(info.value)
    assert message.startswith(
        f"{root} is locked by another writer: pid {os.getpid()} on host {socket.gethostname()} (this process), since "
    )
    assert f"(lock file {root}/{LOCK_NAME})" in message and "break_lock()" in message
    assert info.value.path == str(root) and info.value.holder["pid"] == os.getpid()

    assert sorted(os.listdir(root)) == ["latest", "step_0000000001"]  # nothing of the second writer
    second.save(2, {"w": _full(2), "b": _bias(2), "step": 2})  # the lock was released after the save
    assert second.steps() == [1, 2] and not (root / LOCK_NAME).exists()


def test_hold_lock_until_close(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, hold_lock=True) as owner:
        owner.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
        assert (root / LOCK_NAME).exists()
        other = CheckpointManager(root)
        with pytest.raises(LockedError, match="is locked by another writer"):
            other.save(2, {"w": _full(2), "b": _bias(2), "step": 2})
        assert other.gc(dry_run=True) == []  # reading and dry runs need no lock
        owner.save(2, {"w": _full(2), "b": _bias(2), "step": 2})  # the holder keeps writing
        assert other.lock_holder().pid == os.getpid()
    assert not (root / LOCK_NAME).exists()
    other.save(3, {"w": _full(3), "b": _bias(3), "step": 3})
    assert other.steps() == [1, 2, 3]


def test_broken_lock_stops_its_holder(tmp_path):
    root = tmp_path / "run"
    owner = CheckpointManager(root, hold_lock=True)
    owner.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    holder = CheckpointManager(root).break_lock()
    assert holder.pid == os.getpid()
    intruder = CheckpointManager(root, hold_lock=True)
    intruder.save(2, {"w": _full(2), "b": _bias(2), "step": 2})
    with pytest.raises(LockedError, match="this manager's lock .* was removed while it held it"):
        owner.save(3, {"w": _full(3), "b": _bias(3), "step": 3})
    intruder.close()
    owner.close()
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002"]


def _write_lock(root, **fields):
    root.mkdir(parents=True, exist_ok=True)
    doc = {"format": "ckptlib-lock", "host": socket.gethostname(), "token": "t", "created": "2024-01-01T00:00:00+00:00"}
    doc.update(fields)
    (root / LOCK_NAME).write_text(json.dumps(doc))


def test_stale_lock_of_a_dead_process_is_broken(tmp_path):
    root = tmp_path / "run"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(root, pid=sleeper.pid, start=_process_start(sleeper.pid))
        mgr = CheckpointManager(root)
        with pytest.raises(LockedError, match=f"locked by another writer: pid {sleeper.pid} on host"):
            mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    finally:
        sleeper.kill()
        sleeper.wait()
    with pytest.warns(StaleLockWarning, match=f"removing a stale lock left by pid {sleeper.pid} .*no longer runs"):
        mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001"]


def test_lock_of_a_reused_pid_is_stale(tmp_path):
    root = tmp_path / "run"
    if _process_start(os.getppid()) is None:
        pytest.skip("no /proc: pid reuse cannot be told apart")
    _write_lock(root, pid=os.getppid(), start="1")  # a live pid, but not the process that took the lock
    with pytest.warns(StaleLockWarning):
        CheckpointManager(root).save(1, {"w": _full(1), "b": _bias(1), "step": 1})


def test_leftover_lock_of_this_process_is_stale(tmp_path):
    root = tmp_path / "run"
    _write_lock(root, pid=os.getpid(), start=_process_start(os.getpid()), token="released-long-ago")
    with pytest.warns(StaleLockWarning, match=r"\(this process\)"):
        CheckpointManager(root).save(1, {"w": _full(1), "b": _bias(1), "step": 1})


def test_exit_releases_a_held_lock_but_not_from_a_forked_child(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, hold_lock=True)
    mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    pid = os.fork()
    if pid == 0:  # a forked child (a DataLoader worker, say) exiting must not release it
        mgr.tier.lock._release_at_exit()
        os._exit(0 if (root / LOCK_NAME).exists() else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert (root / LOCK_NAME).exists()
    mgr.tier.lock._release_at_exit()  # what atexit runs at interpreter exit
    assert not (root / LOCK_NAME).exists() and mgr.tier.lock.token is None


def test_lock_of_another_host_needs_break_lock(tmp_path):
    root = tmp_path / "run"
    _write_lock(root, host="elsewhere.example", pid=1)
    mgr = CheckpointManager(root)
    with pytest.raises(LockedError, match="pid 1 on host elsewhere.example, since 2024-01-01"):
        mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    (root / LOCK_NAME).write_text("not json")
    with pytest.raises(LockedError, match="an unknown holder \\(the lock file is unreadable\\)"):
        mgr.gc()
    assert mgr.break_lock().token is None
    mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    assert mgr.steps() == [1]


def _save_into_locked_root(root: str):
    mgr = CheckpointManager(root)
    mgr.save(5, {"w": torch.ones(2)})


def test_locked_root_fails_every_rank(tmp_path, dist_run):
    root = tmp_path / "run"
    _write_lock(root, host="elsewhere.example", pid=4242)
    results = dist_run(2, _save_into_locked_root, str(root), return_exceptions=True)
    assert [type(r) for r in results] == [LockedError] * 2
    assert len({str(r) for r in results}) == 1 and "pid 4242 on host elsewhere.example" in str(results[0])
    assert sorted(os.listdir(root)) == [LOCK_NAME]


def test_durability_order_of_a_save(tmp_path, monkeypatch):
    """What a power loss can leave: the manifest's name is made durable only after every file
    it lists was fsynced and the directory holding their names was too; the pending marker
    is written without a sync of its own, `.metadata` is streamed into its file and fsynced
    when its writer closes (a torn one has no manifest beside it: never committed), and no
    file is fsynced twice. Exact sequence for a one-process save."""
    import ckptlib.storage.local as local

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path)))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.relpath(dst, tmp_path)))
        real_replace(src, dst)

    monkeypatch.setattr(local.os, "fsync", fsync)
    monkeypatch.setattr(local.os, "replace", replace)
    ckptlib.save(str(tmp_path / "ck"), {"w": _full(1), "step": 1})
    monkeypatch.undo()
    tmp_manifest = [p for kind, p in events if kind == "fsync" and p.startswith("ck/ckptlib.json.tmp-")]
    assert len(tmp_manifest) == 1
    assert events == [
        ("rename", "ck/ckptlib.pending"),
        ("fsync", "ck/__0_0.distcp"),  # the rank's own shard, when its writer closes
        ("fsync", "ck/.metadata"),  # the coordinator's `.metadata`, when its writer closes
        ("fsync", "ck"),  # commit: the directory holding every listed name, once
        ("fsync", tmp_manifest[0]),
        ("rename", "ck/ckptlib.json"),
        ("fsync", "ck"),
    ]
    assert sorted(os.listdir(tmp_path / "ck")) == [".metadata", "__0_0.distcp", "ckptlib.json"]


# ---------------------------------------------------------------- the lock after a failure


@pytest.mark.parametrize("intruder", [True, False], ids=["another-holder", "no-holder"])
def test_a_lock_removed_while_held_says_who_holds_it_now(tmp_path, intruder):
    root = tmp_path / "run"
    owner = CheckpointManager(root, hold_lock=True)
    owner.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    CheckpointManager(root).break_lock()
    other = CheckpointManager(root, hold_lock=True)
    if intruder:
        other.save(2, {"w": _full(2), "b": _bias(2), "step": 2})
    holder = other.lock_holder()
    assert (holder is not None) == intruder
    with pytest.raises(LockedError) as info:
        owner.save(3, {"w": _full(3), "b": _bias(3), "step": 3})
    assert str(info.value) == (
        f"{root}: this manager's lock ({root}/{LOCK_NAME}) was removed while it held it"
        + (f"; {holder.describe()} holds it now" if intruder else "")
        + ". Another writer may have written this root; refusing to continue."
    )
    assert info.value.path == str(root)
    other.close()
    owner.close()
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001"] + (["step_0000000002"] if intruder else [])


def _inject(monkeypatch, where: str) -> None:
    """What LocalStorage raises for a full disk, from the shard writer or from set_pointer."""
    from ckptlib.errors import StorageError
    from ckptlib.storage.local import LocalStorage

    def fail(*args, **kwargs):
        raise StorageError(f"No space left on device (injected in {where})")

    monkeypatch.setattr(LocalStorage, {"write": "open_writer", "pointer": "set_pointer"}[where], fail)


@pytest.mark.parametrize("hold_lock", [False, True], ids=["lock-per-save", "hold-lock"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["write", "pointer"])
def test_a_failed_save_releases_the_lock_unless_held(tmp_path, monkeypatch, where, async_save, hold_lock):
    """The lock taken for a save that fails (writing the shards, or moving `latest` after the
    commit) is released at once, never left for the next writer to break as stale; with
    hold_lock=True it stays this manager's, and the manager keeps saving."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, hold_lock=hold_lock, async_save=async_save)
    mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    mgr.wait()
    _inject(monkeypatch, where)
    with pytest.raises(ckptlib.StorageError) as info:
        mgr.save(2, {"w": _full(2), "b": _bias(2), "step": 2})
        mgr.wait()
    assert (
        str(info.value)
        == {"write": "rank 0: ", "pointer": ""}[where] + f"No space left on device (injected in {where})"
    )
    monkeypatch.undo()
    assert mgr.wait() is None
    assert os.readlink(root / "latest") == "step_0000000001"
    assert (LOCK_NAME in os.listdir(root)) == hold_lock
    if hold_lock:
        assert mgr.lock_holder().pid == os.getpid()
        with pytest.raises(LockedError, match="is locked by another writer"):
            CheckpointManager(root).gc()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleLockWarning)  # nothing stale to break
        mgr.save(3, {"w": _full(3), "b": _bias(3), "step": 3})
        mgr.wait()
    mgr.close()
    assert mgr.latest() == 3 and not (root / LOCK_NAME).exists()


def test_a_lock_that_cannot_be_removed_after_a_save_only_warns(tmp_path, monkeypatch):
    from helpers.manager import refuse_lock_deletion

    root = tmp_path / "run"
    refuse_lock_deletion(monkeypatch)
    mgr = CheckpointManager(root)
    with pytest.warns(StaleLockWarning) as caught:
        result = mgr.save(1, {"w": _full(1), "b": _bias(1), "step": 1})
    assert [str(w.message) for w in caught] == [
        f"{root}/{LOCK_NAME}: could not remove the lock ([Errno 13] Permission denied (injected))"
    ]
    assert result.step == 1 and mgr.latest() == 1 and (root / LOCK_NAME).exists()
    monkeypatch.undo()
    with pytest.warns(StaleLockWarning, match=r"\(this process\)"):  # the leftover is this process's: stale
        mgr.save(2, {"w": _full(2), "b": _bias(2), "step": 2})
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002"]
