"""async_save(..., async_mode="process") in one process: the shard written by the writer process
is byte for byte what a synchronous save writes, the staging memory is shared and reused save
after save, every failure of the writer (a write error, a full disk, the writer exiting or killed
with SIGKILL) is raised like a thread-mode failure with nothing committed and no partial file
left, and nothing (process, descriptor, mapping) outlives release_staging() or the parent.
The manager's side (retention, close, preemption) and several ranks: test_async_process_ranks.py."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from helpers.saved_state import assert_equal, shard_bytes
from helpers.writer_faults import BLOCKED_SUFFIX, FaultyShards

import ckptlib
from ckptlib import AsyncMode, StorageError, WriterProcessError
from ckptlib.format import MANIFEST_NAME
from ckptlib.saving import background_save, staging_arena, writer_process
from ckptlib.storage.local import LocalStorage

pytestmark = pytest.mark.skipif(
    staging_arena.unavailable_reason() is not None, reason=str(staging_arena.unavailable_reason())
)


@pytest.fixture(autouse=True)
def _no_writer_left():
    """Every test starts without a writer process and leaves none behind."""
    background_save.release_staging()
    yield
    background_save.release_staging()


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(512, 300, generator=gen),  # 600 KiB: the encoder's path
        "half": torch.randn(301, 7, generator=gen).to(torch.bfloat16),
        "ints": torch.arange(seed, seed + 100),
        "mask": torch.rand(33, generator=gen) > 0.5,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.zeros(0, 5),
        "transposed": torch.randn(40, 30, generator=gen).t(),  # a view: saved as its own bytes
        "objects": {"epoch": seed, "name": f"run-{seed}", "sizes": [1, 2, 3]},
    }


def _zeros_like(state: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    out["objects"] = {"epoch": 0, "name": "", "sizes": []}
    return out


def _memfd_fds() -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "ckptlib-staging" in target:
            found.append(target)
    return found


def _memfd_maps() -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "ckptlib-staging" in line]


def _gone(pid: int, within: float = 30.0) -> bool:
    """Whether `pid` exited (or is a zombie) within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/status") as status:
                if any(line.startswith("State:") and "Z" in line for line in status):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_process_mode_writes_the_bytes_a_synchronous_save_writes(tmp_path):
    state = _state(3)
    handle = ckptlib.async_save(tmp_path / "async", state, step=3, async_mode="process")
    with torch.no_grad():  # the training step right after the call does not reach the checkpoint
        state["big"].add_(1)
        state["objects"]["epoch"] = 99
    result = handle.wait(timeout=120)
    assert (result.step, result.world_size) == (3, 1) and result.blocked_seconds == handle.blocking_seconds
    ckptlib.save(tmp_path / "sync", _state(3), step=3)
    assert shard_bytes(tmp_path / "async") == shard_bytes(tmp_path / "sync")
    got = _zeros_like(_state(3))
    assert ckptlib.load(tmp_path / "async", got).step == 3
    assert_equal(got, _state(3))
    assert ckptlib.format.verify(str(tmp_path / "async")) == []
    writer = writer_process.current()
    assert writer is not None and writer.pid != os.getpid() and not _gone(writer.pid, within=0)
    assert writer.bytes_sent_whole == 0  # every tensor was read from the shared staging memory


def test_many_saves_reuse_the_staging_memory_and_the_writer(tmp_path):
    state = _state(1)
    ckptlib.async_save(tmp_path / "0", state, async_mode="process").wait(timeout=120)
    writer = writer_process.current()
    segments = dict(writer.arena.segments)
    pool = background_save._staging[(None, True)]
    addresses = {key: buf.data_ptr() for key, buf in pool.items()}
    in_arena = {key for key, buf in pool.items() if writer.arena.locate(buf) is not None}
    assert in_arena == set(pool) - {".empty"}  # every buffer with bytes is shared memory
    for n in range(1, 6):
        with torch.no_grad():
            state["big"].fill_(n)
        ckptlib.async_save(tmp_path / str(n), state, step=n, async_mode="process").wait(timeout=60)
        pool = background_save._staging[(None, True)]
        assert {key: buf.data_ptr() for key, buf in pool.items()} == addresses  # the same buffers
        assert writer.arena.segments == segments and writer.arena.live_buffers() == len(in_arena)
    assert writer_process.current() is writer and writer.starts == 1
    got = _zeros_like(state)
    ckptlib.load(tmp_path / "5", got)
    assert torch.equal(got["big"], torch.full((512, 300), 5.0))


def test_a_new_structure_gets_new_buffers_and_frees_the_old(tmp_path):
    ckptlib.async_save(tmp_path / "a", {"w": torch.ones(300_000)}, async_mode="process").wait(timeout=120)
    arena = writer_process.current().arena
    (first,) = arena.segments
    ckptlib.async_save(tmp_path / "b", {"w": torch.ones(500_000), "v": torch.ones(10)}, async_mode="process").wait(
        timeout=60
    )
    assert first not in arena.segments and arena.live_buffers() == 2  # the emptied segment was unmapped
    assert arena.mapped_bytes() <= 3 << 20
    got = {"w": torch.zeros(500_000), "v": torch.zeros(10)}
    ckptlib.load(tmp_path / "b", got)
    assert torch.equal(got["w"], torch.ones(500_000))


def test_release_staging_leaves_no_process_descriptor_or_mapping(tmp_path):
    fds_before = set(os.listdir("/proc/self/fd"))
    ckptlib.async_save(tmp_path / "a", _state(1), async_mode="process").wait(timeout=120)
    pid = writer_process.current().pid
    assert _memfd_fds() and _memfd_maps()
    background_save.release_staging()
    gc.collect()
    assert writer_process.current() is None and _gone(pid, within=0)
    assert _memfd_fds() == [] and _memfd_maps() == []
    assert set(os.listdir("/proc/self/fd")) <= fds_before


def test_background_staging_in_process_mode(tmp_path):
    weights = torch.arange(200_000, dtype=torch.float32)
    handle = ckptlib.async_save(tmp_path / "a", {"w": weights}, step=2, background_staging=True, async_mode="process")
    handle.wait_staged(timeout=120)
    weights.mul_(-1)
    assert handle.wait(timeout=120).step == 2
    got = {"w": torch.zeros(200_000)}
    ckptlib.load(tmp_path / "a", got)
    assert torch.equal(got["w"], torch.arange(200_000, dtype=torch.float32))


def test_unknown_async_mode_is_refused():
    with pytest.raises(ckptlib.StateError, match="async_mode must be 'auto', 'thread' or 'process', got 'fork'"):
        ckptlib.async_save("/nonexistent/never", {"w": torch.ones(1)}, async_mode="fork")


def test_the_manager_checks_async_mode(tmp_path):
    with pytest.raises(ckptlib.StateError, match="async_mode must be 'auto', 'thread' or 'process', got 'fork'"):
        ckptlib.CheckpointManager(tmp_path, async_save=AsyncMode("fork"))
    with pytest.raises(ckptlib.StateError, match=r"^async_save must be a bool or an AsyncMode, got str 'process'$"):
        ckptlib.CheckpointManager(tmp_path, async_save="process")
    assert ckptlib.CheckpointManager(tmp_path, async_save=False).mode is None


class _UnpicklableStorage(LocalStorage):
    """A storage the writer process cannot receive (it holds a lock)."""

    def __init__(self, root: str):
        super().__init__(root)
        self.guard = threading.Lock()


def test_a_storage_that_cannot_be_pickled_is_written_in_the_background_thread(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"_UnpicklableStorage .* cannot be sent to the writer process"):
        handle = ckptlib.async_save(_UnpicklableStorage(str(tmp_path / "a")), _state(4), step=4, async_mode="process")
        result = handle.wait(timeout=120)
    assert result.step == 4
    ckptlib.save(tmp_path / "sync", _state(4), step=4)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "sync")


def test_without_memfd_process_mode_falls_back_to_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_process, "unavailable_reason", lambda: "no memfd here (injected)")
    with pytest.warns(RuntimeWarning, match=r'async_mode="process" is not available here \(no memfd here'):
        handle = ckptlib.async_save(tmp_path / "a", {"w": torch.ones(4)}, async_mode="process")
    assert handle.wait(timeout=60).total_bytes > 0
    assert writer_process.current() is None


def test_the_default_writer_falls_back_to_a_thread_silently_without_memfd(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_process, "unavailable_reason", lambda: "no memfd here (injected)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" chose nothing the user asked for: no warning
        handle = ckptlib.async_save(tmp_path / "a", {"w": torch.ones(4)})
        assert handle.wait(timeout=60).total_bytes > 0
        assert ckptlib.CheckpointManager(tmp_path / "m", async_save=True).mode.writer_here() == "thread"
    assert writer_process.current() is None


def test_the_default_writer_is_one_process_reused_by_every_async_save(tmp_path):
    """With memfd, `async_save` with no mode writes in the writer process, started by the first
    call and reused by the next ones (no start-up per call); the manager starts it at once."""
    for step in (1, 2, 3):
        ckptlib.async_save(tmp_path / f"s{step}", _state(step), step=step).wait(timeout=120)
    writer = writer_process.current()
    assert writer is not None and writer.starts == 1 and writer.bytes_sent_whole == 0
    background_save.release_staging()
    ckptlib.CheckpointManager(tmp_path / "m", async_save=True)
    assert writer_process.current() is not None and writer_process.current().process.poll() is None


# --------------------------------------------------------------------------- failures


def _failed_save_is_clean(target) -> None:
    """Nothing committed, and no shard (whole or partial) left behind."""
    left = sorted(os.listdir(target)) if target.exists() else []
    assert MANIFEST_NAME not in left and not [n for n in left if n.endswith(".distcp")], left


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_write_error_is_raised_like_in_thread_mode(tmp_path, mode):
    """The same StorageError, word for word, whichever mode wrote the shard."""
    target = tmp_path / mode
    handle = ckptlib.async_save(FaultyShards(str(target), "eio"), _state(1), async_mode=mode)
    with pytest.raises(StorageError) as info:
        handle.wait(timeout=120)
    assert str(info.value) == f"rank 0: cannot write {target}/__0_0.distcp: EIO (injected)"
    assert info.value.path == f"{target}/__0_0.distcp"
    _failed_save_is_clean(target)
    # the next save goes ahead (in process mode: the same writer, which survived the error)
    pid = writer_process.current().pid if mode == "process" else None
    ckptlib.async_save(tmp_path / "next", _state(2), async_mode=mode).wait(timeout=60)
    assert (writer_process.current().pid if mode == "process" else None) == pid


def test_the_writer_exiting_mid_file_fails_the_save_and_the_next_one_starts_a_new_writer(tmp_path):
    target = tmp_path / "a"
    handle = ckptlib.async_save(FaultyShards(str(target), "exit"), _state(1), async_mode="process")
    pid = writer_process.current().pid
    with pytest.raises(WriterProcessError) as info:
        handle.wait(timeout=120)
    assert str(info.value) == (
        f"rank 0: the background writer process (pid {pid}) exited (exit code 3) while writing {target}/__0_0.distcp"
    )
    _failed_save_is_clean(target)
    ckptlib.async_save(tmp_path / "b", _state(2), step=2, async_mode="process").wait(timeout=120)
    assert writer_process.current().pid != pid and writer_process.current().starts == 2
    got = _zeros_like(_state(2))
    assert ckptlib.load(tmp_path / "b", got).step == 2
    assert_equal(got, _state(2))


def test_kill_9_of_the_writer_mid_file_fails_the_save(tmp_path):
    target = tmp_path / "a"
    handle = ckptlib.async_save(FaultyShards(str(target), "block"), _state(1), async_mode="process")
    marker = str(target) + BLOCKED_SUFFIX
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = writer_process.current().pid
    assert int(open(marker).read()) == pid  # the writer process itself is the one writing
    assert os.path.exists(target / "__0_0.distcp")  # a partial shard
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WriterProcessError) as info:
        handle.wait(timeout=60)
    assert str(info.value) == (
        f"rank 0: the background writer process (pid {pid}) died (killed by SIGKILL) "
        f"while writing {target}/__0_0.distcp"
    )
    _failed_save_is_clean(target)


def test_a_writer_killed_between_saves_is_replaced_with_a_warning(tmp_path):
    ckptlib.async_save(tmp_path / "a", _state(1), async_mode="process").wait(timeout=120)
    pid = writer_process.current().pid
    os.kill(pid, signal.SIGKILL)
    assert writer_process.current().process.wait(timeout=30) == -signal.SIGKILL
    with pytest.warns(RuntimeWarning, match=rf"writer process \(pid {pid}\) had exited \(exit code -9\) between"):
        handle = ckptlib.async_save(tmp_path / "b", _state(2), step=2, async_mode="process")
    assert handle.wait(timeout=120).step == 2
    got = _zeros_like(_state(2))
    ckptlib.load(tmp_path / "b", got)
    assert_equal(got, _state(2))


def test_the_writer_ignores_a_schedulers_sigterm(tmp_path):
    """SIGTERM to every process of a job: the training process decides (its last save may still
    need the writer); the writer stays."""
    ckptlib.async_save(tmp_path / "a", _state(1), async_mode="process").wait(timeout=120)
    pid = writer_process.current().pid
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    assert not _gone(pid, within=0.5)
    ckptlib.async_save(tmp_path / "b", _state(2), async_mode="process").wait(timeout=60)
    assert writer_process.current().pid == pid


@pytest.mark.timeout(180)
def test_disk_full_in_the_writer_removes_the_partial_shard(tmp_path):
    where = tmp_path / "tmpfs"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        target = where / "ckpt"
        state = {"w": torch.ones(1 << 20)}  # 4 MiB: does not fit
        with pytest.raises(StorageError) as info:
            ckptlib.async_save(target, state, async_mode="process").wait(timeout=120)
        assert "no space left" in str(info.value) and info.value.path == f"{target}/__0_0.distcp"
        _failed_save_is_clean(target)
        small = {"w": torch.ones(1 << 16)}  # the next save succeeds by itself: the space is free again
        ckptlib.async_save(target, small, async_mode="process").wait(timeout=60)
        got = {"w": torch.zeros(1 << 16)}
        ckptlib.load(target, got)
        assert torch.equal(got["w"], small["w"])
    finally:
        background_save.release_staging()
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch, ckptlib
    from ckptlib.saving import writer_process
    from helpers.writer_faults import FaultyShards
    handle = ckptlib.async_save(FaultyShards(sys.argv[1], "block"), {"w": torch.ones(4096)}, async_mode="process")
    while not os.path.exists(sys.argv[1] + ".blocked"):
        time.sleep(0.05)
    print(writer_process.current().pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_the_writer_exits_when_its_parent_dies(tmp_path, how):
    """No orphan: the writer (busy writing) exits as soon as the training process is gone."""
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT if how == "SIGKILL" else _ORPHAN_SCRIPT.replace("time.sleep(600)", "os._exit(0)"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.getcwd()]))
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        if how == "SIGKILL":
            parent.kill()
        parent.wait(timeout=60)
        assert _gone(child, within=30), f"writer process {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait()


_EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, ckptlib
    from ckptlib.saving import writer_process
    ckptlib.async_save(sys.argv[1], {"w": torch.arange(1 << 20, dtype=torch.float32)}, step=5, async_mode="process")
    print(writer_process.current().pid, flush=True)
    # no wait(): interpreter exit waits for the save, then stops the writer
    """
)


def test_exit_without_wait_commits_and_stops_the_writer(tmp_path):
    script = tmp_path / "exit_early.py"
    script.write_text(_EXIT_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=280
    )
    assert run.returncode == 0, run.stderr
    assert _gone(int(run.stdout.strip()), within=30)
    got = {"w": torch.zeros(1 << 20)}
    assert ckptlib.load(tmp_path / "ckpt", got).step == 5
    assert torch.equal(got["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_in_pinned_shared_memory(tmp_path):
    state = {"w": torch.randn(1024, 257, device="cuda"), "b": torch.arange(33, device="cuda")}
    ckptlib.async_save(tmp_path / "a", state, step=1, async_mode="process").wait(timeout=120)
    arena = writer_process.current().arena
    assert arena.segments and all(segment.pinned for segment in arena.segments.values())
    got = {"w": torch.zeros(1024, 257), "b": torch.zeros(33, dtype=torch.int64)}
    ckptlib.load(tmp_path / "a", got)
    assert torch.equal(got["w"], state["w"].cpu()) and torch.equal(got["b"], state["b"].cpu())
