"""What makes a save or load of thousands of tensors cheap (issue 13) changes nothing DCP sees:
compact pickles of plans and write results decode to equal DCP objects, the per-signature
local plans equal DCP's own item for item (index hints included), errors stay DCP's word for
word, `.metadata` stays a plain DCP pickle, and the collector is paused only inside."""

from __future__ import annotations

import gc
import os
import pickle
import threading

import pytest
import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

import ckptlib
from ckptlib._runtime.gc_pause import gc_paused
from ckptlib._torch import dcp_shims
from ckptlib.format.native import plan_codec
from ckptlib.format.native.manifest import FileRecord
from ckptlib.format.read.load_planner import local_load_plan
from ckptlib.format.write.save_planner import global_save_plan, local_save_plan
from ckptlib.testing import launch


def _shard(fqn, offsets, sizes, size, dtype=torch.float32, requires_grad=False, hint=None) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets, hint),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=dtype, requires_grad=requires_grad), size=torch.Size(size)
        ),
    )


def _hints(items) -> list:
    """Index hints, which dataclass equality of MetadataIndex ignores."""
    out = []
    for item in items:
        if isinstance(item, WriteItem):
            out.append(item.index.index)
        else:
            out.append((item.dest_index.index, item.storage_index.index))
    return out


def _round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


class _OwnWriteItem(WriteItem):
    """A WriteItem subclass (a planner of someone else's): the codec must send it as itself."""


def test_save_plan_round_trips_to_equal_dcp_objects():
    items = [
        _shard("a", [0, 0], [2, 3], [4, 3], hint=0),
        _shard("a", [2, 0], [2, 3], [4, 3], hint=1),
        _shard("b", [0], [5], [5], dtype=torch.bfloat16, requires_grad=True),
        _shard("lr", [], [], []),
        WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO),
        _OwnWriteItem(index=MetadataIndex("own", torch.Size([0])), type=WriteItemType.TENSOR),
    ]
    plan = SavePlan(items, storage_data="__1_", planner_data={"a": ("a",)}, usable=False)
    sent = _round_trip(plan_codec.compact_save_plan(plan))
    assert sent == plan and type(sent) is plan_codec.CompactSavePlan
    assert (sent.storage_data, sent.planner_data, sent.usable) == ("__1_", {"a": ("a",)}, False)
    assert _hints(sent.items) == [0, 1, None, None, None, None]
    assert [type(i) for i in sent.items] == [WriteItem] * 5 + [_OwnWriteItem]
    first = sent.items[0]
    assert type(first.index.offset) is torch.Size and type(first.tensor_data.chunk.sizes) is torch.Size
    assert (
        type(first.tensor_data.properties) is TensorProperties and first.tensor_data.properties.dtype == torch.float32
    )
    assert sent.items[2].tensor_data.properties == TensorProperties(dtype=torch.bfloat16, requires_grad=True)


def test_compact_pickle_is_smaller_than_dcps():
    items = [_shard(f"layers.{i}.w", [0, 0], [40, 80], [80, 80]) for i in range(500)]
    plain, compact = SavePlan(items), plan_codec.compact_save_plan(SavePlan(items))
    assert len(pickle.dumps(compact)) < len(pickle.dumps(plain)) / 2


def test_plans_of_other_classes_are_left_alone():
    class OwnPlan(SavePlan):
        pass

    own = OwnPlan([_shard("a", [0], [1], [1])])
    assert plan_codec.compact_save_plan(own) is own
    assert plan_codec.compact_save_plan(SavePlan([])) == SavePlan([])


def test_load_plan_round_trips_to_equal_dcp_objects():
    read = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("a", torch.Size([2, 0]), 1),
        dest_offsets=torch.Size([0, 1]),
        storage_index=MetadataIndex("a", torch.Size([0, 0]), 0),
        storage_offsets=torch.Size([2, 1]),
        lengths=torch.Size([2, 2]),
    )
    byte_read = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("step"),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("step"),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    plan = LoadPlan([read, byte_read], storage_data={"x": 1}, planner_data=[1])
    sent = _round_trip(plan_codec.compact_load_plan(plan))
    assert sent == plan and type(sent) is plan_codec.CompactLoadPlan
    assert _hints(sent.items) == [(1, 0), (None, None)]
    assert all(type(i) is ReadItem and type(i.lengths) is torch.Size for i in sent.items)


def test_write_results_round_trip_with_the_shard_record():
    info = dcp_shims.storage_info_cls()
    results = plan_codec.WriteResults()
    results.info_cls = info
    results.append(
        WriteResult(
            index=MetadataIndex("a", torch.Size([0]), 3), size_in_bytes=10, storage_data=info("__0_0.distcp", 0, 10)
        )
    )
    results.append(WriteResult(index=MetadataIndex("o"), size_in_bytes=4, storage_data={"not": "a storage info"}))
    results.shard = ("__0_0.distcp", FileRecord(size=14, crc32=5, items=[(0, 10, 1), (10, 4, 2)]))
    sent = _round_trip(results)
    assert list(sent) == list(results) and sent.shard == results.shard
    assert sent[0].index.index == 3 and type(sent[0].storage_data) is info
    assert pickle.dumps(sent[0].storage_data) == pickle.dumps(results[0].storage_data)  # what `.metadata` holds


# --------------------------------------------------------------------------- the global plan


def _layouts() -> dict[str, list[SavePlan]]:
    rows = [SavePlan([_shard("w", [r * 2, 0], [2, 5], [8, 5]), _shard("v", [r], [1], [4])]) for r in range(4)]
    byte = WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)
    mixed = [
        SavePlan([_shard("g", [0, 3 * r], [2, 3], [2, 6]), byte])
        if r == 0
        else SavePlan([_shard("g", [0, 3 * r], [2, 3], [2, 6])])
        for r in range(2)
    ]
    return {"rows": rows, "bytes-on-one-rank": mixed, "empty": [SavePlan([]), SavePlan([])]}


@pytest.mark.parametrize("name", list(_layouts()))
def test_global_plan_equals_dcps(name, monkeypatch):
    """Equal to DCP's global plan, and made by ckptlib's own pass (not by handing the plans
    back to DCP, which costs a dataclasses.replace per item at 10,000 tensors)."""
    from ckptlib.format.write import save_planner

    plans = _layouts()[name]
    expected_plans, expected_md = create_default_global_save_plan(plans)
    handed_back = []
    monkeypatch.setattr(
        save_planner,
        "create_default_global_save_plan",
        lambda *args: handed_back.append(args) or create_default_global_save_plan(*args),
    )
    got_plans, got_md = global_save_plan(plans)
    assert handed_back == []
    assert got_plans == expected_plans and got_md == expected_md
    assert [_hints(p.items) for p in got_plans] == [_hints(p.items) for p in expected_plans]


def test_global_plan_leaves_a_duplicate_object_key_to_dcps_error():
    byte = WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)
    plans = [SavePlan([byte]), SavePlan([byte])]
    with pytest.raises(AssertionError) as ours:
        global_save_plan(plans)
    with pytest.raises(AssertionError) as theirs:
        create_default_global_save_plan(plans)
    assert str(ours.value) == str(theirs.value)


# --------------------------------------------------------------------------- local plans, on ranks


def _state(world: int, *, load_layout: bool = False, stages: bool = False) -> dict:
    """DTensors of many signatures; with `stages`, first one that only rank 0's pipeline stage
    holds (a mesh the other ranks are not in: they plan no items for it, and go on)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)

    def full(*shape, dtype=torch.float32):
        return torch.rand(shape, generator=gen).to(dtype)

    row, col = ([Shard(1)], [Shard(0)]) if load_layout else ([Shard(0)], [Shard(1)])
    stage0 = {"stage0": distribute_tensor(full(3, 2), DeviceMesh("cpu", [0]), [Replicate()])} if stages else {}
    return {
        "model": {
            **stage0,
            "a": distribute_tensor(full(7, 5), mesh, row),  # uneven rows
            "b": distribute_tensor(full(7, 5), mesh, row),  # a's signature
            "c": distribute_tensor(full(6, 9), mesh, col),
            "d": distribute_tensor(full(4, 4), mesh, [Replicate()]),
            "e": distribute_tensor(full(8, 3, dtype=torch.bfloat16), mesh, row),
            "f": distribute_tensor(full(7, 5).requires_grad_(), mesh, row),  # a's shape, other flags
            "g": distribute_tensor(full(2, 6), grid, [Replicate(), Shard(1)]),
            "h": distribute_tensor(full(7, 5), grid, [Replicate(), Shard(0)]),  # a's shape on another mesh
            "i": distribute_tensor(full(8, 4), grid, [Shard(0), Shard(0)]),
            "j": _strided(full(8, 4), grid),  # i's shape and mesh, FSDP2 x TP's strided placement
        },
        "plain": torch.arange(5),
        "step": 3,
    }


def _strided(full: torch.Tensor, grid):
    """`full` with FSDP2 x TP's placements on `grid`: _StridedShard(0) over dp, Shard(0) over tp."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tp = grid.size(1)
    rank = grid.get_local_rank(1)
    rows = full.shape[0] // tp
    return DTensor.from_local(
        full[rank * rows : (rank + 1) * rows].contiguous(),
        grid,
        [_StridedShard(0, split_factor=tp), Shard(0)],
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def _flat(state: dict) -> dict:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=False)
    return planner.state_dict


def rank_compare_plans(world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import Partial

    rank = dist.get_rank()
    flat = _flat(_state(world, stages=True))
    asked = []
    real = dcp_shims.create_write_items
    dcp_shims.create_write_items = lambda fqn, obj: asked.append(fqn) or real(fqn, obj)
    try:
        ours = local_save_plan(flat, rank == 0)
    finally:
        dcp_shims.create_write_items = real
    dcp_plan = create_default_local_save_plan(flat, rank == 0)
    out = {"asked_dcp": asked, "keys": list(flat)}
    out.update(save_equal=ours == dcp_plan, save_hints=_hints(ours.items) == _hints(dcp_plan.items))
    plans = [None] * world
    dist.all_gather_object(plans, dcp_plan)
    _, metadata = create_default_global_save_plan(dcp_shims.dedup_save_plans(plans, False))
    target = _flat(_state(world, load_layout=True, stages=True))
    from ckptlib.format.read import chunk_index, load_planner

    load_asked = []  # every key planned by DCP's local load plan or, for a DTensor, by chunk_index's reads
    real_load = load_planner.create_default_local_load_plan
    real_reads = chunk_index.read_items
    load_planner.create_default_local_load_plan = lambda sd, *a: load_asked.extend(sd) or real_load(sd, *a)
    chunk_index.read_items = lambda fqn, *a: load_asked.append(fqn) or real_reads(fqn, *a)
    try:
        ours = local_load_plan(target, metadata, True)
    finally:
        load_planner.create_default_local_load_plan = real_load
        chunk_index.read_items = real_reads
    dcp_plan = create_default_local_load_plan(target, metadata, True)
    out["load_asked_dcp"] = load_asked
    out["load_keys"] = list(target)
    out["load_equal"] = ours == dcp_plan and len(ours.items) > len(target)  # resharded: several reads a tensor
    out["load_hints"] = _hints(ours.items) == _hints(dcp_plan.items)

    def errors(fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - compared below
            return type(exc).__name__, str(exc)
        return None

    missing = {**target, "model.extra": target["model.a"]}
    out["missing"] = (
        errors(local_load_plan, missing, metadata, True),
        errors(create_default_local_load_plan, missing, metadata, True),
    )
    out["lenient"] = local_load_plan(missing, metadata, False) == create_default_local_load_plan(
        missing, metadata, False
    )
    resized = {**target, "model.c": _flat(_state(world))["model.a"]}
    out["resized"] = (
        errors(local_load_plan, resized, metadata, True),
        errors(create_default_local_load_plan, resized, metadata, True),
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    partial = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (world,)), [Partial()])
    out["partial"] = (
        errors(local_save_plan, {"p": partial}, True),
        errors(create_default_local_save_plan, {"p": partial}, True),
    )
    return out


@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"ranks{w}")
def test_local_plans_equal_dcps_item_for_item(world):
    for rank, out in enumerate(launch(world, rank_compare_plans, world)):
        assert out["save_equal"] and out["save_hints"] and out["load_equal"] and out["load_hints"] and out["lenient"]
        # one DCP call per DTensor signature: "model.b" has "model.a"'s, so its items are a's, renamed
        assert out["asked_dcp"] == [
            key for key in out["keys"] if key != "model.b" and (rank == 0 or key != "model.stage0")
        ]
        # the load plan too: "model.b" reuses "model.a"'s read items (same mesh, placements, shape, chunks)
        assert "model.a" in out["load_asked_dcp"] and "model.b" not in out["load_asked_dcp"]
        assert set(out["load_asked_dcp"]) <= set(out["load_keys"])
        for case in ("missing", "resized"):
            ours, theirs = out[case]
            assert ours is not None and ours == theirs, (case, ours, theirs)
        ours, theirs = out["partial"]  # DCP refuses Partial placements from torch 2.9 on; 2.8 does not
        assert ours == theirs, (ours, theirs)


def rank_save(path: str) -> int:
    from torch.distributed.tensor import DTensor

    state = _state(2)
    result = ckptlib.save(path, state)
    loaded = _state(2, load_layout=True)
    with torch.no_grad():
        for tensor in loaded["model"].values():
            tensor.to_local().zero_()
    ckptlib.load(path, loaded)
    for name, tensor in state["model"].items():
        assert torch.equal(tensor.full_tensor(), loaded["model"][name].full_tensor()), name
        assert isinstance(loaded["model"][name], DTensor)
    return result.total_bytes


def test_metadata_stays_a_plain_dcp_pickle_and_every_rank_gets_the_size(tmp_path):
    path = str(tmp_path / "ckpt")
    sizes = launch(2, rank_save, path)
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    manifest = os.path.getsize(os.path.join(path, "ckptlib.json"))
    assert sizes == [on_disk - manifest] * 2  # SaveResult.total_bytes counts every file but the manifest
    with open(os.path.join(path, ".metadata"), "rb") as f:
        blob = f.read()
    assert b"plan_codec" not in blob and b"dcp_writer" not in blob and b"_SavedMetadata" not in blob
    metadata = FileSystemReader(path).read_metadata()
    assert (
        type(metadata) is Metadata
        and type(metadata.storage_data[MetadataIndex("model.a", [0, 0])]) is dcp_shims.storage_info_cls()
    )


# --------------------------------------------------------------------------- the collector


def test_gc_paused_nests_and_restores_the_collectors_state():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that disabled it keeps it disabled
    finally:
        gc.enable()


def test_gc_paused_across_threads_enables_once_the_last_leaves():
    inside, leave = threading.Event(), threading.Event()

    def background():
        with gc_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=background)
    thread.start()
    inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the background operation is still inside
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_gc_paused_restores_the_collector_after_an_error():
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_placements_key_tells_strided_shards_from_shards():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    keys = {
        plan_codec.placements_key(p)
        for p in ([Shard(0)], [_StridedShard(0, split_factor=2)], [_StridedShard(0, split_factor=4)], [Replicate()])
    }
    assert len(keys) == 4
    assert plan_codec.placements_key([Shard(1), Replicate()]) == plan_codec.placements_key((Shard(1), Replicate()))
