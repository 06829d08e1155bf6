"""Async save (`ckptlib.async_save(...)`) and the reader/writer fast paths.

Async: the state is staged before `save` returns (with `background_staging=True`, before
`wait_staged()` returns), written and committed in a background
thread whose collectives run on a dedicated gloo group; a background failure surfaces from
`wait()` on every rank and never leaves a manifest; a process that exits without `wait()`
still commits (atexit).

Fast paths (ckptlib.format.read.dcp_reader): items of at least 1 MiB are read by preadv straight into
the destination and checksummed there, or (unverified, resharded) only their needed rows are
read; these tests use tensors large enough to take them, at several world sizes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import AsyncMode
from ckptlib.format import MANIFEST_NAME
from ckptlib.testing.matrices import matrix as mx

ROWS, COLS = 4099, 300  # 4.9 MB of float32: every shard above the 1 MiB fast-path threshold, uneven over 2-4 ranks


def _full(seed: int, rows: int = ROWS, cols: int = COLS, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(dtype)


def _sharded(full: torch.Tensor, dim: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return distribute_tensor(full, mesh, [Shard(dim)])


def _state(seed: int) -> dict:
    return {
        "w": _sharded(_full(seed)),
        "cols": _sharded(_full(seed + 1, 256, 4101), dim=1),  # column-sharded: non-contiguous reshard reads
        "half": _sharded(_full(seed + 2, 3001, 800, torch.bfloat16)),
        "small": _sharded(_full(seed + 3, 10, 3)),
        "extra": {"step": seed, "name": f"s{seed}"},
    }


def _empty_state() -> dict:
    return {
        "w": _sharded(torch.zeros(ROWS, COLS)),
        "cols": _sharded(torch.zeros(256, 4101), dim=1),
        "half": _sharded(torch.zeros(3001, 800, dtype=torch.bfloat16)),
        "small": _sharded(torch.zeros(10, 3)),
        "extra": {"step": -1, "name": ""},
    }


def _check_state(state: dict, seed: int) -> list[str]:
    expected = {
        "w": _full(seed),
        "cols": _full(seed + 1, 256, 4101),
        "half": _full(seed + 2, 3001, 800, torch.bfloat16),
        "small": _full(seed + 3, 10, 3),
    }
    problems = []
    for key, want in expected.items():
        got = state[key].full_tensor()
        if got.dtype != want.dtype or not torch.equal(got, want):
            problems.append(f"{key} differs")
    if state["extra"] != {"step": seed, "name": f"s{seed}"}:
        problems.append(f"extra: {state['extra']}")
    return problems


# --------------------------------------------------------------------------- async save


def _async_save_then_train(uri: str) -> dict:
    """Save asynchronously, mutate the state at once (as a training step would), then wait."""
    state = _state(7)
    handle = ckptlib.async_save(uri, state, step=7)
    assert isinstance(handle, ckptlib.AsyncSave)
    with torch.no_grad():  # the "training step": every tensor and plain value changes
        for key in ("w", "cols", "half", "small"):
            state[key].to_local().add_(1)
        state["extra"]["step"] = 8
    # the caller's default group stays usable while the background works on its own group
    flag = torch.ones(1)
    dist.all_reduce(flag)
    result = handle.wait(timeout=60)
    assert handle.done() and handle.result() is result
    return {"step": result.step, "world": result.world_size, "blocking": handle.blocking_seconds, "sum": flag.item()}


def _load_and_check(uri: str, seed: int) -> list[str]:
    state = _empty_state()
    result = ckptlib.load(uri, state)
    assert result.step == seed
    return _check_state(state, seed)


def test_async_save_at_2_load_at_3_bit_exact_after_mutation(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    out = dist_run(2, _async_save_then_train, uri)
    assert [o["step"] for o in out] == [7, 7] and [o["world"] for o in out] == [2, 2]
    assert all(o["sum"] == 2 for o in out)
    assert os.path.exists(os.path.join(uri, MANIFEST_NAME))
    assert dist_run(3, _load_and_check, uri, 7) == [[], [], []]


def _async_twice_same_buffers(root: str) -> list[int]:
    """Two async saves in a row: the second waits for the first and reuses its staging buffers,
    which must not corrupt the first checkpoint."""
    state = _state(3)
    first = ckptlib.async_save(f"{root}/a", state, step=3)
    with torch.no_grad():
        state["w"].to_local().mul_(-1)
    second = ckptlib.async_save(f"{root}/b", state, step=4)  # waits for `first`
    assert first.done()
    second.wait()
    return [first.result().step, second.result().step]


def test_consecutive_async_saves(tmp_path, dist_run):
    root = str(tmp_path)
    assert dist_run(2, _async_twice_same_buffers, root) == [[3, 4], [3, 4]]
    assert dist_run(2, _load_and_check, f"{root}/a", 3) == [[], []]


def _async_with_failing_rank(uri: str, bad_rank: int):
    from ckptlib.storage.local import LocalStorage

    if dist.get_rank() == bad_rank:

        def broken_writer(self, path):
            raise OSError(28, "No space left on device (injected)")

        LocalStorage.open_writer = broken_writer
    # the fault is patched into this process: the thread writer (the writer process's: test_async_process*.py)
    handle = ckptlib.async_save(uri, _state(5), step=5, async_mode="thread")
    try:
        handle.wait(timeout=60)
    except ckptlib.CheckpointError as exc:
        # the handle keeps failing the same way, and the default group still works
        with pytest.raises(ckptlib.CheckpointError):
            handle.result()
        flag = torch.ones(1)
        dist.all_reduce(flag)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _background_staging_then_train(uri: str) -> dict:
    """background_staging=True: save returns before the copy; the "training step" waits for
    wait_staged() and then changes everything; the checkpoint holds the values before it."""
    state = _state(9)
    handle = ckptlib.async_save(uri, state, step=9, background_staging=True)
    handle.wait_staged(timeout=60)
    staged_after = handle.staged_seconds
    with torch.no_grad():
        for key in ("w", "cols", "half", "small"):
            state[key].to_local().mul_(-3)
        state["extra"]["name"] = "changed"
    result = handle.wait(timeout=60)
    return {"step": result.step, "ordered": handle.blocking_seconds <= staged_after <= handle.seconds}


def test_background_staging_saves_the_state_before_the_next_step(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    assert dist_run(2, _background_staging_then_train, uri) == [{"step": 9, "ordered": True}] * 2
    assert dist_run(3, _load_and_check, uri, 9) == [[], [], []]


def _background_staging_fails_on(uri: str, bad_rank: int) -> list[str]:
    from ckptlib.saving import background_save

    if dist.get_rank() == bad_rank:

        def no_memory(key, value, pool, used):
            raise MemoryError(f"cannot stage {key} (injected)")

        background_save._staged_tensor = no_memory
    handle = ckptlib.async_save(uri, _state(5), step=5, background_staging=True)
    seen = []
    for wait in (handle.wait_staged, handle.wait):
        try:
            wait(timeout=60)
            seen.append("no error")
        except ckptlib.CheckpointError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def test_background_staging_failure_reaches_every_rank(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    seen = dist_run(2, _background_staging_fails_on, uri, 1)
    expected = "CheckpointError: rank 1: MemoryError: cannot stage .w (injected)"
    assert seen == [[expected, expected]] * 2
    assert not os.path.exists(uri) or MANIFEST_NAME not in os.listdir(uri)


def test_background_staging_needs_async(tmp_path):
    with pytest.raises(TypeError, match="background_staging"):  # only async_save stages in the background
        ckptlib.save(tmp_path / "c", {"w": torch.ones(2)}, background_staging=True)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ckptlib.StateError, match=r"^AsyncMode background_staging must be a bool, got 'yes'$"):
        AsyncMode(background_staging="yes")
    assert ckptlib.CheckpointManager(tmp_path / "r", async_save=AsyncMode(background_staging=True)).mode == AsyncMode(
        "auto", True
    )


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_background_failure_surfaces_on_every_rank_and_never_commits(tmp_path, dist_run, bad_rank):
    uri = str(tmp_path / "ckpt")
    errors = dist_run(2, _async_with_failing_rank, uri, bad_rank)
    for rank, err in enumerate(errors):
        assert err.startswith("CheckpointError") or err.startswith("StorageError"), (rank, err)
        assert "No space left on device" in err, (rank, err)
    assert not os.path.exists(os.path.join(uri, MANIFEST_NAME))
    with pytest.raises(ckptlib.CheckpointError):
        ckptlib.load(uri, {"w": torch.zeros(ROWS, COLS)})


def test_async_save_single_process_and_unwaited_failure_is_reported(tmp_path):
    state = {"w": _full(1), "n": 1}
    handle = ckptlib.async_save(str(tmp_path / "a"), state, step=1)
    state["w"].zero_()
    assert handle.wait(timeout=60).step == 1
    loaded = {"w": torch.zeros(ROWS, COLS), "n": 0}
    ckptlib.load(str(tmp_path / "a"), loaded)
    assert torch.equal(loaded["w"], _full(1)) and loaded["n"] == 1

    # a committed checkpoint at the target: the failure is raised by wait(), not lost ...
    bad = ckptlib.async_save(str(tmp_path / "b"), state, step=1)
    bad.wait()
    with pytest.raises(ckptlib.CheckpointExistsError):
        ckptlib.save(str(tmp_path / "b"), state, step=2)
    onto_committed = ckptlib.async_save(str(tmp_path / "b"), state, step=2)
    with pytest.raises(ckptlib.CheckpointExistsError):  # the target is prepared in the background
        onto_committed.wait()
    assert ckptlib.load(str(tmp_path / "b"), {"w": torch.zeros(ROWS, COLS), "n": 0}).step == 1  # untouched
    # ... and a background failure nobody waited for is raised by the next async save
    from ckptlib.storage.local import LocalStorage

    original = LocalStorage.open_writer
    try:
        LocalStorage.open_writer = lambda self, path: (_ for _ in ()).throw(OSError(5, "EIO (injected)"))
        failed = ckptlib.async_save(str(tmp_path / "c"), state, step=3)
        failed._done.wait(60)
    finally:
        LocalStorage.open_writer = original
    with pytest.raises(ckptlib.CheckpointError, match="nobody waited"):
        ckptlib.async_save(str(tmp_path / "d"), state, step=4)
    assert not os.path.exists(tmp_path / "c" / MANIFEST_NAME)
    ckptlib.async_save(str(tmp_path / "d"), state, step=4).wait()  # reported once, then usable


_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    # registered before ckptlib's handler, so it runs after it (atexit is last-in, first-out)
    atexit.register(lambda: print(sys.argv[2], file=sys.stderr, flush=True))
    import torch, torch.distributed as dist
    import ckptlib
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    state = {"w": torch.arange(3_000_000, dtype=torch.float32) + rank, "step": 9}
    if world > 1:
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        state["w"] = distribute_tensor(torch.arange(3_000_000, dtype=torch.float32), mesh, [Shard(0)])
    ckptlib.async_save(sys.argv[1], state, step=9)
    # no wait(): the interpreter exits right away and atexit must let the save commit
    """
)


_EXIT_HANDLERS_DONE = "exit-handlers-done"


def _gloo_teardown_abort(returncode: int, stderr: str) -> bool:
    """gloo's known abort while C++ objects are torn down (about 1 run in 20, without ckptlib too),
    told apart from a failure: it comes after every atexit handler, ckptlib's included, returned."""
    lines = stderr.splitlines()
    return (
        returncode == -signal.SIGABRT
        and _EXIT_HANDLERS_DONE in lines
        and any(
            "terminate called without an active exception" in line
            for line in lines[lines.index(_EXIT_HANDLERS_DONE) + 1 :]
        )
    )


@pytest.mark.parametrize("world", [1, 2])
def test_exit_without_wait_still_commits(tmp_path, world):
    import socket

    uri = str(tmp_path / "ckpt")
    script = tmp_path / "exit_early.py"
    script.write_text(_EXIT_SCRIPT)
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), uri, _EXIT_HANDLERS_DONE], env=dict(env, RANK=str(r)), stderr=subprocess.PIPE
        )
        for r in range(world)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 or _gloo_teardown_abort(proc.returncode, err.decode()), err.decode()
    assert os.path.exists(os.path.join(uri, MANIFEST_NAME))
    loaded = {"w": torch.zeros(3_000_000), "step": 0}
    assert ckptlib.load(uri, loaded).step == 9
    assert torch.equal(loaded["w"], torch.arange(3_000_000, dtype=torch.float32)) and loaded["step"] == 9


def _async_fsdp2_round(uri: str) -> dict:
    model, opt = mx.setup("fsdp2", "adamw", seed=0)
    for step in range(2):
        mx.train_step(model, opt, step)
    state = {"model": model, "optim": opt, "step": 2}
    handle = ckptlib.async_save(uri, state, step=2)
    expected = mx.full_state(model, opt)  # collectives on the default group while the save runs
    mx.train_step(model, opt, 2)  # and a training step
    handle.wait(timeout=60)
    return expected


def test_async_fsdp2_save_at_4_load_at_2(tmp_path, dist_run):
    from ckptlib._torch import parallel

    if parallel.fsdp2_cpu_reason():
        pytest.skip(parallel.fsdp2_cpu_reason())
    uri = str(tmp_path / "ckpt")
    expected = dist_run(4, _async_fsdp2_round, uri)[0]
    assert dist_run(2, mx.load_side, uri, "fsdp2", "adamw", expected) == [[], []]


# --------------------------------------------------------------------------- reader fast paths


def _save_sync(uri: str, seed: int) -> None:
    ckptlib.save(uri, _state(seed), step=seed)


def _load_verify(uri: str, seed: int, verify: bool) -> list[str]:
    from ckptlib.format.read import dcp_reader

    fast = []
    original = dcp_reader.CkptReader._read_local_tensor

    def counting(self, *args, **kwargs):
        took = original(self, *args, **kwargs)
        fast.append(took)
        return took

    dcp_reader.CkptReader._read_local_tensor = counting  # this rank is a fresh process
    state = _empty_state()
    assert ckptlib.load(uri, state, verify=verify).step == seed
    problems = _check_state(state, seed)
    if not fast or not all(fast):
        problems.append(f"fast path taken {sum(fast)} of {len(fast)} times")
    return problems


@pytest.mark.parametrize("save_ws,load_ws", [(1, 3), (3, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("verify", [True, False])
def test_large_items_reshard_bit_exact(tmp_path, dist_run, save_ws, load_ws, verify):
    uri = str(tmp_path / "ckpt")
    dist_run(save_ws, _save_sync, uri, 11)
    assert dist_run(load_ws, _load_verify, uri, 11, verify) == [[]] * load_ws


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_reads_what_the_streaming_writer_wrote(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"a": _full(1), "b": _full(2, 700, 700, torch.bfloat16), "n": 3}
    ckptlib.save(str(tmp_path / "c"), state)
    out = {"a": torch.zeros(ROWS, COLS), "b": torch.zeros(700, 700, dtype=torch.bfloat16), "n": 0}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")))
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"]) and out["n"] == 3


def test_streamed_items_match_torch_save_bytes(tmp_path):
    """Each item is byte for byte what torch.save into a BytesIO produces (the format DCP writes)."""
    import io
    import json

    state = {"a": _full(1), "b": _full(2)[::2], "c": torch.arange(5)}  # b: a strided view, saved compact
    ckptlib.save(str(tmp_path / "c"), state)
    manifest = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    data = (tmp_path / "c" / "__0_0.distcp").read_bytes()
    blobs = []
    for off, length, _ in manifest["files"]["__0_0.distcp"]["items"]:
        blobs.append(data[off : off + length])
    expected = []
    for value in (state["a"], state["b"].contiguous(), state["c"]):
        buf = io.BytesIO()
        torch.save(value, buf)
        expected.append(buf.getvalue())
    assert sorted(blobs) == sorted(expected)


@pytest.mark.parametrize("where", ["header", "data", "tail"])
@pytest.mark.parametrize("reshard", [False, True])
def test_corruption_in_a_large_item_is_detected(tmp_path, where, reshard):
    """A flipped byte anywhere in a fast-path item (zip header, tensor data, central directory)
    fails the verified whole load. A partial load (rows 100..149, in the file's first 1 MiB
    checksum block) verifies the blocks it reads and those of the zip records that located
    its rows (the last block): it fails for damage in the header or the tail, and reads its
    rows intact past damage elsewhere (`ckpt verify` reports that)."""
    import json

    state = {"a": _full(1)}
    uri = str(tmp_path / "c")
    ckptlib.save(uri, state)
    manifest = json.loads((tmp_path / "c" / MANIFEST_NAME).read_text())
    off, length, _ = manifest["files"]["__0_0.distcp"]["items"][0]
    pos = {"header": off + 10, "data": off + length // 2, "tail": off + length - 10}[where]
    path = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x40
    path.write_bytes(bytes(raw))
    target = {"a": torch.zeros(ROWS, COLS)}
    if reshard:  # a load that needs only some rows: verifies the blocks that hold them
        from ckptlib.format.source import open_reader

        reader, info = open_reader(ckptlib.storage.open_storage(uri), verify=True)
        from helpers.readers import IntoTensor
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = info.metadata.state_dict_metadata["a"]
        items = create_read_items_for_chunk_list(
            "a", md, [ChunkStorageMetadata(torch.Size([100, 0]), torch.Size([50, COLS]))]
        )
        out = torch.zeros(50, COLS)

        assert manifest["files"]["__0_0.distcp"]["blocks"]["size"] == 1 << 20
        last_block = length // (1 << 20)  # the item is the whole file: blocks 0..4, the last short
        if where in ("header", "tail"):  # the blocks of the rows and of the zip records that located them
            block = 0 if where == "header" else last_block
            with pytest.raises(ckptlib.CheckpointCorruptError, match=f"file block {block} "):
                reader.read_data(LoadPlan(items), IntoTensor(out)).wait()
        else:
            reader.read_data(LoadPlan(items), IntoTensor(out)).wait()
            assert torch.equal(out, state["a"][100:150])
            assert reader.bytes_read == length - (last_block - 1) * (1 << 20)  # blocks 0 and 4 of 0..4
        return
    with pytest.raises(ckptlib.CheckpointCorruptError):
        ckptlib.load(uri, target)
    ckptlib.load(uri, target, verify=False) if where == "data" else None  # unverified: no check, no crash


# --------------------------------------------------------------------------- CheckpointManager(async_save=True)


def _manager_async_run(root: str, fail_step: int | None) -> dict:
    from ckptlib.storage.local import LocalStorage

    if fail_step is not None and dist.get_rank() == 1:
        original = LocalStorage.open_writer

        def broken(self, path):  # only the failing step's writes (a background thread runs them)
            if step_dir_name(fail_step) in self.root:
                raise OSError(5, "EIO (injected)")
            return original(self, path)

        LocalStorage.open_writer = broken
    # a fault patched into this process reaches the thread writer only (the writer process's: test_async_process*.py)
    mgr = ckptlib.CheckpointManager(root, keep_last=2, async_save=True if fail_step is None else AsyncMode("thread"))
    state = _state(1)
    seen = {"errors": [], "latest_after_save": []}
    for step in (1, 2, 3, 4):
        try:
            handle = mgr.save(step, state)
        except ckptlib.CheckpointError as exc:  # the previous step's background failure
            seen["errors"].append((step, str(exc)))
            handle = mgr.save(step, state)  # reported once; this save goes ahead
        assert isinstance(handle, ckptlib.AsyncSave)
        with torch.no_grad():
            state["w"].to_local().add_(1)  # train on while the save runs
        seen["latest_after_save"].append(mgr.latest())
    mgr.wait()
    seen["latest"] = mgr.latest()
    seen["steps"] = mgr.steps()
    mgr.close()
    return seen


def step_dir_name(step: int) -> str:
    from ckptlib.format.native.root import step_dir

    return step_dir(step)


def test_manager_async_saves_publish_and_apply_retention(tmp_path, dist_run):
    root = str(tmp_path / "run")
    out = dist_run(2, _manager_async_run, root, None)
    for seen in out:
        assert seen["errors"] == [] and seen["latest"] == 4 and seen["steps"] == [3, 4]
        assert seen["latest_after_save"][1:] == [1, 2, 3]
    assert sorted(os.listdir(root)) == ["latest", "step_0000000003", "step_0000000004"]
    # step 4 holds the state as it was when save(4) returned: w advanced by 3 after step 1's
    problems = dist_run(3, _load_step_w, root, 4, 3)
    assert problems == [[], [], []]


def _load_step_w(root: str, step: int, added: int) -> list[str]:
    state = _empty_state()
    mgr = ckptlib.CheckpointManager(root)
    assert mgr.load(state) == step
    want = _full(1)
    for _ in range(added):  # exactly the additions the saving run made (float: not `+ added`)
        want.add_(1)
    return [] if torch.equal(state["w"].full_tensor(), want) else ["w differs"]


def test_manager_async_failure_surfaces_on_next_call_and_never_moves_latest(tmp_path, dist_run):
    root = str(tmp_path / "run")
    out = dist_run(2, _manager_async_run, root, 2)
    for rank, seen in enumerate(out):
        assert [s for s, _ in seen["errors"]] == [3], (rank, seen)  # step 2's failure, at the next call
        assert "EIO (injected)" in seen["errors"][0][1], (rank, seen)
        # save(n) returns with step n in flight and step n-1 published; step 2 never is
        assert seen["latest_after_save"][1:] == [1, 1, 3], (rank, seen)
        assert seen["latest"] == 4 and seen["steps"] == [3, 4]
    assert "step_0000000002" not in os.listdir(root)  # debris removed by the next retention pass


_EXIT_MANAGER_SCRIPT = textwrap.dedent(
    """
    import sys, torch, ckptlib
    mgr = ckptlib.CheckpointManager(sys.argv[1], async_save=True)
    mgr.save(5, {"w": torch.arange(3_000_000, dtype=torch.float32)})
    # no wait(), no close(): exit must let the save commit, publish, and only then unlock
    """
)


def test_manager_exit_without_wait_commits_publishes_and_unlocks(tmp_path):
    root = tmp_path / "run"
    script = tmp_path / "exit_mgr.py"
    script.write_text(_EXIT_MANAGER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(root)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert sorted(os.listdir(root)) == ["latest", "step_0000000005"]  # committed, pointed to, lock gone
    assert ckptlib.CheckpointManager(str(root)).latest() == 5


def test_manager_background_staging_publishes_the_staged_state(tmp_path):
    state = {"w": _full(4), "n": 4}
    with ckptlib.CheckpointManager(tmp_path / "run", async_save=AsyncMode(background_staging=True)) as mgr:
        handle = mgr.save(4, state)
        handle.wait_staged(timeout=60)
        state["w"].zero_()
        state["n"] = 5
        mgr.wait()
        target = {"w": torch.zeros(ROWS, COLS), "n": -1}
        assert mgr.load(target) == 4
    assert torch.equal(target["w"], _full(4)) and target["n"] == 4
    assert os.readlink(tmp_path / "run" / "latest") == "step_0000000004"
