"""A world re-initialized in one process: `destroy_process_group()`, then `init_process_group()`
on a new store (an in-process elastic restart). What ckptlib keeps per world (the dedicated
gloo groups of async saves and of a load's shared reads, the check-in serials, the heartbeat,
the cluster tier's topology) must follow the new world on every public path: each path saves
and loads bit-exactly in both worlds; a group of the old world is a clear ProcessGroupError.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import AsyncMode, Cluster
from ckptlib._torch import c10d

TIMEOUT = datetime.timedelta(seconds=60)
_stores: list = []  # the new worlds' stores, alive until the rank exits (rank 0 hosts them)

ASYNC = {
    "async-thread": AsyncMode("thread"),
    "async-process": AsyncMode("process"),
    "async-thread-cap": AsyncMode("thread", max_staging_bytes=1 << 16),
    "async-process-cap": AsyncMode("process", max_staging_bytes=1 << 16),
    "async-thread-background-staging": AsyncMode("thread", background_staging=True),
}


def _new_world(n: int):
    """Leave this world and join a new one on a new TCPStore (rank 0 hosts it on a new port,
    handed over through the old store); the new store."""
    rank, world = dist.get_rank(), dist.get_world_size()
    old = c10d.default_store()
    key = f"test/new_world/{n}"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, TIMEOUT, wait_for_workers=False)
        old.set(key, str(store.port))
    else:
        store = dist.TCPStore("127.0.0.1", int(old.get(key)), world, False, TIMEOUT)
    _stores.append(store)
    ckptlib.exit_barrier(timeout_s=60)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    return store


def _state(seed: int) -> dict:
    """A sharded DTensor, a tensor every rank holds alike (read once, exchanged), a plain value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {
        "w": distribute_tensor(torch.randn(64, 32, generator=g), mesh, [Shard(0)]),
        "r": torch.randn(4096, generator=g),
        "step": seed,
    }


def _assert_loaded(got: dict, want: dict) -> None:
    assert torch.equal(got["w"].to_local(), want["w"].to_local())
    assert torch.equal(got["r"], want["r"]) and got["step"] == want["step"]


def _save(how: str, uri: str, state: dict) -> None:
    if how == "save":
        ckptlib.save(uri, state, step=state["step"])
        return
    mode = ASYNC[how]
    handle = ckptlib.async_save(
        uri,
        state,
        step=state["step"],
        async_mode=mode.writer,
        background_staging=mode.background_staging,
        max_staging_bytes=mode.max_staging_bytes,
    )
    assert handle.wait().step == state["step"]


def _round_trip(how: str, uri: str, seed: int) -> None:
    saved = _state(seed)
    _save(how, uri, saved)
    target = _state(seed + 100)
    result = ckptlib.load(uri, target)
    assert result.step == seed
    _assert_loaded(target, saved)


@pytest.mark.timeout(240)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("how", ["save", *ASYNC])
def test_save_and_load_work_again_in_a_new_world(tmp_path, how):
    base = str(tmp_path)
    _round_trip(how, os.path.join(base, "world1-a"), 1)
    _round_trip(how, os.path.join(base, "world1-b"), 2)  # a second save of the world (cached groups)
    _new_world(1)
    _round_trip(how, os.path.join(base, "world2-a"), 3)
    _round_trip(how, os.path.join(base, "world2-b"), 4)
    saved = _state(1)  # what the first world wrote still loads in the new one
    target = _state(200)
    ckptlib.load(os.path.join(base, "world1-a"), target)
    _assert_loaded(target, saved)
    # this world's collective calls checked in and beat in its own store, from serial 0
    # (a process that joins a world starts there too)
    store = c10d.default_store()
    assert all(store.add(f"ckptlib/heartbeat/{r}", 0) > 0 for r in range(dist.get_world_size()))
    assert store.check([f"ckptlib/check_in/load/0/{_tag()}/all"])
    assert store.check([f"ckptlib/check_in/save/0/{_tag()}/all"])


def _kept_for(group) -> set[str]:
    """What the async saves keep for `group`'s next save (its staging memory)."""
    from ckptlib.saving import background_save, capped_staging

    return {"pool" for key in background_save._staging if key[0] is group} | {
        "ring" for key in capped_staging._rings if key[0] is group
    }


def _tag() -> str:
    import zlib

    return f"{zlib.crc32(','.join(map(str, range(dist.get_world_size()))).encode()):08x}"


@pytest.mark.timeout(240)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("mode", ["sync", "async-thread", "async-process"])
def test_a_manager_saves_and_loads_in_the_new_world(tmp_path, mode):
    root = str(tmp_path / "run")
    async_save = False if mode == "sync" else ASYNC[mode]
    manager = ckptlib.CheckpointManager(root, async_save=async_save)
    manager.save(1, _state(1))
    manager.wait()
    _new_world(1)
    manager.save(2, _state(2))  # the same manager, made in the old world
    manager.wait()
    target = _state(300)
    assert manager.load(target) == 2
    _assert_loaded(target, _state(2))
    fresh = ckptlib.CheckpointManager(root, async_save=async_save)  # and one made in the new world
    fresh.save(3, _state(3))
    fresh.wait()
    target = _state(300)
    assert fresh.load(target) == 3
    _assert_loaded(target, _state(3))
    assert manager.steps() == [1, 2, 3]
    manager.close()
    fresh.close()


@pytest.mark.timeout(240)
@pytest.mark.world_size(2)
def test_the_cluster_tier_uploads_after_a_new_world(tmp_path):
    remote = str(tmp_path / "remote")
    node = str(tmp_path / "node")
    manager = ckptlib.CheckpointManager(node, cluster=Cluster(remote=remote))
    manager.save(1, _state(1))
    assert manager.wait().step == 1
    _new_world(1)
    # rank 1 as a process that joined the new world (a manager of its own, made there); rank 0
    # keeps the one it had: both take the inventory anew, so their collectives match
    if dist.get_rank() == 1:
        manager.close()
        manager = ckptlib.CheckpointManager(node, cluster=Cluster(remote=remote))
    manager.save(2, _state(2))
    assert manager.wait().step == 2  # uploaded: the step is on the remote
    assert manager.steps() == [1, 2]
    target = _state(300)
    assert manager.path(2).startswith(remote)
    ckptlib.load(manager.path(2), target)  # the remote's copy, read as a plain checkpoint
    _assert_loaded(target, _state(2))
    fresh = ckptlib.CheckpointManager(str(tmp_path / "other-node"), cluster=Cluster(remote=remote))
    target = _state(300)
    assert fresh.load(target) == 2  # a node with nothing local resumes from the remote
    _assert_loaded(target, _state(2))
    manager.close()
    fresh.close()


@pytest.mark.timeout(240)
@pytest.mark.world_size(2)
def test_a_group_of_the_old_world_is_a_clear_error_on_every_public_call(tmp_path):
    uri, root = str(tmp_path / "ckpt"), str(tmp_path / "run")
    old_group = dist.new_group(backend="gloo")
    ckptlib.save(uri, _state(1), step=1, process_group=old_group)
    manager = ckptlib.CheckpointManager(root, process_group=old_group)
    manager.save(1, _state(1))
    for cap in (1 << 16, None):  # staging kept for the old group's next save (a pool, a ring)
        ckptlib.async_save(uri + "-a", _state(1), process_group=old_group, max_staging_bytes=cap, overwrite=True).wait()
    assert _kept_for(old_group) == {"pool", "ring"}
    _new_world(1)
    calls = {  # each raises before any collective, so the next one runs on every rank alike
        "save": (lambda: ckptlib.save(uri + "-2", _state(2), process_group=old_group), f"save to {uri}-2"),
        "async_save": (
            lambda: ckptlib.async_save(uri + "-2", _state(2), process_group=old_group).wait(),
            f"save to {uri}-2",
        ),
        "load": (lambda: ckptlib.load(uri, _state(2), process_group=old_group), f"load of {uri}"),
        "manager.save": (lambda: manager.save(2, _state(2)), f"save of step 2 to {root}"),
        "manager.load": (lambda: manager.load(_state(2)), f"load from {root}"),
        "manager.maybe_save": (lambda: manager.maybe_save(2, _state(2), force=True), f"maybe_save of step 2 to {root}"),
        "manager.latest": (manager.latest, f"latest of {root}"),
        "manager.gc": (manager.gc, f"gc of {root}"),
        "manager.break_lock": (manager.break_lock, f"break_lock of {root}"),
    }
    for call, (run, what) in calls.items():
        with pytest.raises(ckptlib.ProcessGroupError) as caught:
            run()
        assert str(caught.value) == (
            f"{what} on rank {dist.get_rank()}: its process group is not part of this process's torch.distributed "
            "world (destroyed, or made before destroy_process_group()); pass a group of the current world "
            "(a CheckpointManager keeps the group it was made with: make a new one)"
        ), call
        assert caught.value.rank == dist.get_rank(), call
    assert not os.path.exists(uri + "-2")
    assert _kept_for(old_group) == set()  # freed with the old world: no save of that group can come
    assert ckptlib.CheckpointManager(root).steps() == [1]  # nothing of the old world's step lost
    ckptlib.load(uri, target := _state(3))  # the default group works on
    _assert_loaded(target, _state(1))
    ckptlib.exit_barrier(timeout_s=60)
    dist.destroy_process_group()  # and with no world at all, a group is named as the cause
    with pytest.raises(ckptlib.ProcessGroupError) as caught:
        ckptlib.save(uri + "-3", {"x": torch.zeros(2)}, process_group=old_group)
    assert str(caught.value) == (
        f"save to {uri}-3: a process group was passed, but torch.distributed is not initialized in this process "
        "(destroy_process_group() was called); call init_process_group() and pass a group of the new world"
    )
