"""async_mode="process" across ranks and through the manager: DTensor and FSDP2 states saved at
one world size load bit-exactly at another; a writer failing on one rank fails the save on every
rank (the same named error), never moves `latest`, leaves no partial shard, and the next save
commits; retention works as in thread mode with one writer per rank for every save; `close()`
leaves no writer process, memfd or mapping; a preemption signal while a process-mode save is in
flight (sent to the writer too, as a scheduler signals a whole job) ends with both steps saved."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from helpers.writer_faults import FaultyShards

import ckptlib
from ckptlib import AsyncMode, CheckpointManager, EveryNSteps
from ckptlib._torch import host_memory
from ckptlib.format import MANIFEST_NAME
from ckptlib.format.native.root import step_dir
from ckptlib.saving import background_save, staging_arena, writer_process
from ckptlib.testing.matrices import matrix as mx

pytestmark = pytest.mark.skipif(
    staging_arena.unavailable_reason() is not None, reason=str(staging_arena.unavailable_reason())
)


def _full(seed: int, rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(dtype)


def _sharded(full: torch.Tensor, dim: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(full, init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(dim)])


_SHAPES = {
    "w": (1027, 300, torch.float32, 0),
    "cols": (64, 1001, torch.float32, 1),
    "half": (501, 80, torch.bfloat16, 0),
}


def _state(seed: int, fill: bool = True) -> dict:
    state: dict = {}
    for i, (key, (rows, cols, dtype, dim)) in enumerate(_SHAPES.items()):
        full = _full(seed + i, rows, cols, dtype) if fill else torch.zeros(rows, cols, dtype=dtype)
        state[key] = _sharded(full, dim)
    state["small"] = _sharded(_full(seed + 9, 3, 2) if fill else torch.zeros(3, 2))  # empty shards at 4 ranks
    state["extra"] = {"step": seed if fill else -1, "name": f"s{seed}" if fill else ""}
    return state


def _problems(state: dict, seed: int) -> list[str]:
    want = _state(seed)
    bad = [k for k in (*_SHAPES, "small") if not torch.equal(state[k].full_tensor(), want[k].full_tensor())]
    return bad + ([f"extra: {state['extra']}"] if state["extra"] != want["extra"] else [])


def _load_and_check(uri: str, seed: int) -> list[str]:
    state = _state(seed, fill=False)
    assert ckptlib.load(uri, state).step == seed
    return _problems(state, seed)


def _leaks() -> list[str]:
    """memfds and mappings of the staging arena still in this process."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "ckptlib-staging" in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(f"fd {fd}")
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        found += [line.strip() for line in maps if "ckptlib-staging" in line]
    return found


# --------------------------------------------------------------------------- round trips


def _save_then_train(uri: str) -> dict:
    state = _state(7)
    handle = ckptlib.async_save(uri, state, step=7, async_mode="process")
    with torch.no_grad():  # the training step right after the call
        for key in (*_SHAPES, "small"):
            state[key].to_local().add_(1)
        state["extra"]["step"] = 8
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the default group stays the caller's
    result = handle.wait(timeout=120)
    pid = writer_process.current().pid
    sent_whole = writer_process.current().bytes_sent_whole  # 0: every shard read from shared memory
    background_save.release_staging()
    # what staging uses for a GPU mesh's DTensor, checked here on a CPU mesh: the same DTensor
    over = host_memory.dtensor_over(state["w"].to_local().clone(), state["w"])
    same = over.placements == state["w"].placements and torch.equal(over.full_tensor(), state["w"].full_tensor())
    out = {
        "step": result.step,
        "writer": pid != os.getpid(),
        "sum": flag.item(),
        "leaks": _leaks(),
        "whole": sent_whole,
    }
    return {**out, "dtensor_over": same and over.device_mesh == state["w"].device_mesh}


def test_dtensor_state_saved_at_2_in_process_mode_loads_at_3(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    want = {"step": 7, "writer": True, "sum": 2.0, "leaks": [], "whole": 0, "dtensor_over": True}
    assert dist_run(2, _save_then_train, uri) == [want] * 2
    assert dist_run(3, _load_and_check, uri, 7) == [[], [], []]


def _fsdp2_round(uri: str) -> dict:
    model, opt = mx.setup("fsdp2", "adamw", seed=0)
    for step in range(2):
        mx.train_step(model, opt, step)
    handle = ckptlib.async_save(uri, {"model": model, "optim": opt, "step": 2}, step=2, async_mode="process")
    expected = mx.full_state(model, opt)  # collectives on the default group while the save runs
    mx.train_step(model, opt, 2)
    handle.wait(timeout=120)
    assert writer_process.current().bytes_sent_whole == 0  # model and optimizer read from shared memory
    background_save.release_staging()
    return expected


def test_fsdp2_saved_at_4_in_process_mode_loads_at_2(tmp_path, dist_run):
    from ckptlib._torch import parallel

    if parallel.fsdp2_cpu_reason():
        pytest.skip(parallel.fsdp2_cpu_reason())
    uri = str(tmp_path / "ckpt")
    expected = dist_run(4, _fsdp2_round, uri)[0]
    assert dist_run(2, mx.load_side, uri, "fsdp2", "adamw", expected) == [[], []]


# --------------------------------------------------------------------------- the manager


def _manager_retention(root: str) -> dict:
    mgr = CheckpointManager(root, keep_last=2, async_save=AsyncMode("process"))
    pids = []
    for step in range(1, 5):
        mgr.save(step, _state(step)).wait(timeout=120)
        pids.append(writer_process.current().pid)
    out = {"steps": mgr.steps(), "latest": mgr.latest(), "one_writer": len(set(pids)) == 1}
    out["starts"] = writer_process.current().starts
    mgr.close()
    out["after_close"] = {"writer": writer_process.current(), "leaks": _leaks()}
    out["pid_gone"] = not os.path.exists(f"/proc/{pids[0]}")
    return out


def test_manager_retention_one_writer_per_rank_and_nothing_left_after_close(tmp_path, dist_run):
    root = str(tmp_path / "run")
    for out in dist_run(2, _manager_retention, root):
        assert out == {
            "steps": [3, 4],
            "latest": 4,
            "one_writer": True,
            "starts": 1,
            "after_close": {"writer": None, "leaks": []},
            "pid_gone": True,
        }
    assert dist_run(3, _load_and_check, f"{root}/{step_dir(4)}", 4) == [[], [], []]


def _manager_writer_fails_on(root: str, bad_rank: int, fault: str) -> dict:
    mgr = CheckpointManager(root, async_save=AsyncMode("process"))
    mgr.save(1, _state(1)).wait(timeout=120)
    if dist.get_rank() == bad_rank:  # only this rank's writer meets the fault, only in step 2
        mgr.storage = mgr.tier.storage = FaultyShards(mgr.storage.root, fault, under=step_dir(2))
    pid = writer_process.current().pid
    mgr.save(2, _state(2))
    try:
        mgr.save(3, _state(3))  # raises step 2's failure and does not save step 3
        error = None
    except ckptlib.CheckpointError as exc:
        error = f"{type(exc).__name__}: {exc}"
    failed = os.path.join(root, step_dir(2))
    after = {"latest": mgr.latest(), "files": sorted(os.listdir(failed)) if os.path.isdir(failed) else []}
    mgr.save(3, _state(3)).wait(timeout=120)  # the next save runs (a new writer where it died)
    out = {"error": error, "pid": pid, "new_writer": writer_process.current().pid != pid, **after}
    out["latest_after"] = mgr.latest()
    mgr.close()
    return out


@pytest.mark.parametrize("fault", ["eio", "exit"])
def test_a_writer_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path, dist_run, fault):
    root = str(tmp_path / "run")
    outs = dist_run(2, _manager_writer_fails_on, root, 1, fault)
    shard = f"{root}/{step_dir(2)}/__1_0.distcp"
    if fault == "eio":
        want = f"StorageError: rank 1: cannot write {shard}: EIO (injected)"
    else:
        bad_pid = outs[1]["pid"]
        want = f"WriterProcessError: rank 1: the background writer process (pid {bad_pid}) exited (exit code 3) "
        want += f"while writing {shard}"
    for rank, out in enumerate(outs):
        assert out["error"] == want, (rank, out)
        assert out["latest"] == 1 and out["latest_after"] == 3, (rank, out)
        assert MANIFEST_NAME not in out["files"] and not [n for n in out["files"] if n.endswith(".distcp")], out
        assert out["new_writer"] == (fault == "exit" and rank == 1), (rank, out)
    assert dist_run(2, _load_and_check, f"{root}/{step_dir(3)}", 3) == [[], []]


def _wait_until_ignored(pid: int, sig: int) -> None:
    """The writer ignores `sig` from the first line its interpreter runs; wait for that line."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
        if ignored & (1 << (sig - 1)):
            return
        time.sleep(0.01)
    raise AssertionError(f"writer {pid} never ignored signal {sig}")


def _preempted_while_in_flight(root: str) -> dict:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    mgr = CheckpointManager(root, save_policy=EveryNSteps(100), preemption=True, async_save=AsyncMode("process"))
    mgr.storage = mgr.tier.storage = FaultyShards(
        mgr.storage.root, "slow", delay=0.05, under=step_dir(1)
    )  # step 1 stays in flight
    assert mgr.maybe_save(1, _state(1), force=True)
    in_flight = not mgr._pending.done()
    pid = writer_process.current().pid
    _wait_until_ignored(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGTERM)  # the scheduler signals every process of the job...
    os.kill(os.getpid(), signal.SIGTERM)  # ...the training process records it
    time.sleep(0.1)
    saved = mgr.maybe_save(2, _state(2))  # every rank saves now, and waits for it
    out = {
        "in_flight": in_flight,
        "saved": saved,
        "preempted": mgr.preempted,
        "pending": mgr._pending,
        "steps": mgr.steps(),
        "latest": mgr.latest(),
        "same_writer": writer_process.current().pid == pid,
    }
    mgr.close()
    out["handlers_restored"] = {s: signal.getsignal(s) for s in before} == before
    return out


def test_preemption_while_a_process_mode_save_is_in_flight_saves_both_steps(tmp_path, dist_run):
    root = str(tmp_path / "run")
    for out in dist_run(2, _preempted_while_in_flight, root):
        assert out == {
            "in_flight": True,
            "saved": True,
            "preempted": True,
            "pending": None,
            "steps": [1, 2],
            "latest": 2,
            "same_writer": True,
            "handlers_restored": True,
        }
    for step in (1, 2):
        assert dist_run(2, _load_and_check, f"{root}/{step_dir(step)}", step) == [[], []]
