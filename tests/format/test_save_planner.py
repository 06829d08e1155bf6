"""CkptSavePlanner: the same global plan and Metadata as DCP's DefaultSavePlanner, the same
errors, but DCP's quadratic overlap check is skipped for plans that tile their tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.default_planner as default_planner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ckptlib.format.native.structure import find_overlap
from ckptlib.format.write.save_planner import CkptSavePlanner, chunks_tile_exactly


def _shard(fqn: str, offsets, sizes, size) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size(size)
        ),
    )


def _replicated(fqn: str, size) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=torch.Size(size))
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size(size)
        ),
    )


def _bytes(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _plans(per_rank: list[list[WriteItem]]) -> list[SavePlan]:
    return [SavePlan(items, planner_data={item.index.fqn: (item.index.fqn,) for item in items}) for items in per_rank]


def _rows(world: int, rows: int, cols: int, fqn: str = "w") -> list[list[WriteItem]]:
    """`fqn` of shape (world * rows, cols), row-sharded: rank r holds rows [r * rows, (r + 1) * rows)."""
    return [[_shard(fqn, [r * rows, 0], [rows, cols], [world * rows, cols])] for r in range(world)]


def _grid(a: int, b: int) -> list[list[WriteItem]]:
    """A (2a, 3b) tensor cut into a x b chunks of (2, 3), one per rank (2-D sharding)."""
    return [[_shard("g", [2 * i, 3 * j], [2, 3], [2 * a, 3 * b])] for i in range(a) for j in range(b)]


def _merge(*layouts: list[list[WriteItem]]) -> list[list[WriteItem]]:
    return [sum((layout[r] for layout in layouts), []) for r in range(len(layouts[0]))]


VALID = {
    "one-rank": [[_shard("w", [0, 0], [4, 8], [4, 8]), _bytes("step")]],
    "rows-wide": _rows(8, 1, 1000),  # the quadratic case of DCP's sweep: every chunk spans the largest dim
    "rows-tall": _rows(8, 100, 3),
    "columns": [[_shard("c", [0, 5 * r], [7, 5], [7, 20])] for r in range(4)],
    "grid-2x3": _grid(2, 3),
    "replicated-and-bytes": _merge(_rows(4, 2, 16), [[_replicated("bias", [16]), _bytes("epoch")] for _ in range(4)]),
    "scalar": [[_replicated("lr", [])] for _ in range(2)],
    "many-tensors": _merge(*(_rows(4, 1, 9, fqn=f"layer{i}.w") for i in range(20))),
}


@pytest.mark.parametrize("layout", list(VALID.values()), ids=list(VALID))
def test_same_plan_and_metadata_as_dcp_without_its_check(layout, monkeypatch):
    expected_plans, expected_metadata = DefaultSavePlanner().create_global_plan(_plans(layout))
    calls = []
    original = default_planner._validate_global_plan
    monkeypatch.setattr(default_planner, "_validate_global_plan", lambda *a: calls.append(a) or original(*a))
    planner = CkptSavePlanner()
    plans, metadata = planner.create_global_plan(_plans(layout))
    assert plans == expected_plans
    assert metadata == expected_metadata
    assert planner.metadata == metadata
    assert planner.global_plan == []  # not kept after the scatter: an item per chunk of every rank (issue 25.5)
    assert calls == []  # DCP's own O(chunks^2) check never ran


def _overlap() -> list[list[WriteItem]]:
    rows = _rows(3, 2, 10)
    rows[2] = [_shard("w", [3, 0], [2, 10], [6, 10])]  # rows 3-4 overlap rank 1's rows 2-3; row 5 is a gap
    return rows


INVALID = {
    "overlap": _overlap(),
    "outside": [[_shard("w", [0, 0], [2, 4], [4, 4])], [_shard("w", [2, 0], [4, 4], [4, 4])]],
    "duplicate-offsets": [[_shard("w", [0, 0], [2, 4], [4, 4])], [_shard("w", [0, 0], [2, 4], [4, 4])]],
    "wide-overlap-among-many": _rows(16, 1, 500)[:15] + [[_shard("w", [7, 0], [1, 500], [16, 500])]],
}


@pytest.mark.parametrize("layout", list(INVALID.values()), ids=list(INVALID))
def test_an_invalid_plan_fails_with_dcps_own_error(layout, caplog):
    with pytest.raises(ValueError) as dcp_error:
        DefaultSavePlanner().create_global_plan(_plans(layout))
    with pytest.raises(ValueError) as ckpt_error:
        CkptSavePlanner().create_global_plan(_plans(layout))
    assert str(ckpt_error.value) == str(dcp_error.value)
    assert str(ckpt_error.value).startswith("Failed to validate global plan")


def test_a_rank_that_lacks_a_sharded_tensor_is_named():
    """Rank 2 holds no piece of a tensor ranks 0 and 1 shard (a key missing on one rank of its
    mesh): RanksDisagreeError naming the key and the ranks, not DCP's bare volume error (issue 26)."""
    from ckptlib.errors import RanksDisagreeError

    with pytest.raises(RanksDisagreeError) as info:
        CkptSavePlanner().create_global_plan(_plans(_rows(3, 2, 10)[:2] + [[]]))
    assert info.value.keys == ["w"] and info.value.ranks == [0, 1, 2]
    assert "w: sharded float32 (6, 10) held by ranks 0, 1 only, whose pieces cover 40 of its 60 elements" in str(
        info.value
    )


def test_zero_size_chunks_are_left_to_dcp(monkeypatch):
    """A tensor smaller than the world (pytorch/pytorch#108869) has empty chunks: DCP decides."""
    layout = [[_shard("t", [min(r, 3), 0], [1 if r < 3 else 0, 5], [3, 5])] for r in range(4)]
    expected = DefaultSavePlanner().create_global_plan(_plans(layout))
    calls = []
    original = default_planner._validate_global_plan
    monkeypatch.setattr(default_planner, "_validate_global_plan", lambda *a: calls.append(a) or original(*a))
    assert CkptSavePlanner().create_global_plan(_plans(layout)) == expected
    assert len(calls) == 1


@pytest.mark.parametrize(
    "chunks, expected",
    [
        ([((0, 0), (2, 9)), ((2, 0), (2, 9))], None),
        ([((0, 0), (2, 9)), ((1, 0), (2, 9))], (((0, 0), (2, 9)), ((1, 0), (2, 9)))),
        (
            [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 2), (2, 4))],
            (((2, 0), (2, 3)), ((2, 2), (2, 4))),
        ),
        ([((0,), (0,)), ((0,), (4,))], None),  # an empty chunk holds no element
        ([((0,), (4,)), ((10,), (4,)), ((12,), (4,))], (((10,), (4,)), ((12,), (4,)))),  # ends past 2 x size
    ],
    ids=["rows-apart", "rows-overlap", "grid-overlap", "empty-chunk", "overlap-far-from-zero"],
)
def test_find_overlap(chunks, expected):
    assert find_overlap(list(chunks)) == expected


def _outcome(planner, plans):
    try:
        return planner.create_global_plan(plans)
    except Exception as exc:  # noqa: BLE001 - compared below
        return type(exc), str(exc)


def test_a_tensor_after_an_object_is_still_checked_for_tiling():
    """Objects and 0-d tensors have no chunks to check; a tensor after them still does: half
    a tensor's chunks is never taken as surely valid."""
    step = WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)
    _, metadata = create_default_global_save_plan(_plans([[step, _shard("w", [0, 0], [2, 4], [4, 4])]]))
    assert list(metadata.state_dict_metadata) == ["step", "w"]
    assert not chunks_tile_exactly(metadata)


def test_a_tensor_not_covered_by_one_ranks_chunks_is_left_to_dcp():
    """Whether DCP refuses a one-rank plan that covers half a tensor changed between releases
    (torch 2.8 checks the volume for one plan too; newer DCP only across ranks): such a plan is
    never taken as surely valid, and the save planner's outcome is DCP's, whichever it is."""
    _, metadata = create_default_global_save_plan(_plans([[_shard("w", [0, 0], [2, 4], [4, 4])]]))
    assert not chunks_tile_exactly(metadata)
    half = [[_shard("w", [0, 0], [2, 4], [4, 4])]]
    assert _outcome(CkptSavePlanner(), _plans(half)) == _outcome(DefaultSavePlanner(), _plans(half))


@pytest.mark.parametrize("differs", ["plan-fields", "no-dtensor"])
def test_plans_are_dcps_own_where_torch_differs(tmp_path, monkeypatch, differs):
    """Where torch's plan classes have fields ckptlib's codec does not know, or torch has no
    DTensor, the local save and load plans are DCP's own (`create_default_local_*_plan`), and
    the checkpoint still round-trips bit-exact."""
    import ckptlib
    from ckptlib._torch import probes
    from ckptlib.format.native import plan_codec
    from ckptlib.format.read import load_planner
    from ckptlib.format.write import plan_cache, save_planner

    plan_cache.clear_shared()  # an earlier save of this structure would be reused, not planned
    calls = []
    for module, name in [
        (save_planner, "create_default_local_save_plan"),
        (load_planner, "create_default_local_load_plan"),
    ]:
        dcp_plan = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=dcp_plan, _n=name, **k: calls.append(_n) or _f(*a, **k))
    if differs == "plan-fields":
        for module in (save_planner, load_planner, plan_codec):
            monkeypatch.setattr(module, "KNOWN_FIELDS", False)
    else:
        monkeypatch.setattr(probes, "dtensor_cls", lambda: None)
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)
    ckptlib.save(tmp_path / "c", {"model": saved, "step": 5})
    loaded, state = torch.nn.Linear(4, 3), {"step": 0}
    state["model"] = loaded
    ckptlib.load(tmp_path / "c", state)
    assert calls == ["create_default_local_save_plan", "create_default_local_load_plan"]
    assert torch.equal(loaded.weight, saved.weight) and torch.equal(loaded.bias, saved.bias) and state["step"] == 5


def test_a_chunk_of_another_rank_than_its_tensor_is_left_to_dcp():
    """A chunk whose offsets or sizes have another number of dimensions than its tensor is never
    taken as surely valid (DCP's own check then decides)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    def metadata(offsets, sizes):
        props = TensorProperties(dtype=torch.float32)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        return Metadata({"w": TensorStorageMetadata(properties=props, size=torch.Size([4, 4]), chunks=[chunk])})

    assert chunks_tile_exactly(metadata([0, 0], [4, 4]))
    assert not chunks_tile_exactly(metadata([0], [16]))
    assert not chunks_tile_exactly(metadata([0, 0], [4, 4, 1]))


@pytest.mark.parametrize("fields", ["with-modules", "without-modules"])
def test_the_metadata_marker_is_added_whichever_storage_meta_torch_has(tmp_path, monkeypatch, fields):
    """The writer tags `.metadata` as ckptlib's through StorageMeta.modules, a field older torch
    lacks: with it, the marker is appended to what torch put there; without it, it is the one entry."""
    import dataclasses

    from ckptlib.format.write import dcp_writer
    from ckptlib.storage import open_storage

    @dataclasses.dataclass
    class OldStorageMeta:
        checkpoint_id: object = None
        save_id: object = None
        load_id: object = None

    if fields == "without-modules":
        monkeypatch.setattr(dcp_writer, "StorageMeta", OldStorageMeta)
    writer = dcp_writer.CkptWriter.__new__(dcp_writer.CkptWriter)
    writer.storage = open_storage(str(tmp_path))
    meta = writer.storage_meta()
    assert meta.modules == [dcp_writer.METADATA_MARKER]
