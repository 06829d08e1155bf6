"""`ckptlib.dcp.writer` / `ckptlib.dcp.reader` as the storage of a user's own `dcp.save`,
`dcp.async_save` and `dcp.load`: the behaviours PyTorch's own DCP tests exercise with
FileSystemWriter/Reader (round trips with tensors and objects, the deprecated
save_state_dict/load_state_dict, one directory saved again and again, resharding DTensors
across world sizes and placements, `checkpoint_id=` resetting the storage, async saves on the
thread and the process executors), and what ckptlib adds: a committed manifest written in
DCP's own rounds, a failed save removed on every rank, ckptlib's errors carried by DCP's
CheckpointException, unsafe pickles refused by the reader whatever the planner. The same on
S3, GCS and Azure: tests/storage/test_dcp_storage_cloud.py; DCP's stream extensions:
tests/format/test_dcp_extensions.py."""

from __future__ import annotations

import errno
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import ckptlib
import ckptlib.dcp
from ckptlib.format import MANIFEST_NAME, PENDING_NAME, verify
from ckptlib.storage import LocalStorage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _inner(exc: CheckpointException) -> BaseException:
    """The one failure a CheckpointException carries (DCP gathers them per rank)."""
    failures = list(exc.failures.values())
    assert len(failures) == 1, exc.failures
    return failures[0][0] if isinstance(failures[0], tuple) else failures[0]


class Blob:
    """A stateful object DCP calls state_dict()/load_state_dict() on."""

    def __init__(self, value: bytes):
        self.state = {"blob": value}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 1), nn.EmbeddingBag(5, 10))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_trip_with_tensors_objects_and_a_stateful(tmp_path):
    uri = str(tmp_path / "ckpt")
    saved = {**_module(0).state_dict(), "blob": Blob(b"some bytes"), "objs": {"a": [1], "b": "text"}}
    metadata = dcp.save(saved, storage_writer=ckptlib.dcp.writer(uri))
    assert sorted(os.listdir(uri)) == [".metadata", "__0_0.distcp", MANIFEST_NAME]
    assert len(metadata.state_dict_metadata) == 8  # the Metadata DCP returns stays whole
    assert verify(uri) == []
    target = {**_module(1).state_dict(), "blob": Blob(b""), "objs": {"a": [2], "b": "other"}}
    dcp.load(target, storage_reader=ckptlib.dcp.reader(uri))
    assert _equal({k: v for k, v in target.items() if k not in ("blob", "objs")}, _module(0).state_dict())
    assert target["blob"].state == {"blob": b"some bytes"} and target["objs"] == {"a": [1], "b": "text"}
    plain = _module(2).state_dict()  # DCP's own reader reads it too
    dcp.load(plain, storage_reader=dcp.FileSystemReader(uri))
    assert _equal(plain, _module(0).state_dict())


def test_deprecated_no_dist_entry_points(tmp_path):
    uri = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.save_state_dict(_module(0).state_dict(), storage_writer=ckptlib.dcp.writer(uri), no_dist=True)
        target = _module(1).state_dict()
        dcp.load_state_dict(target, storage_reader=ckptlib.dcp.reader(uri), no_dist=True)
    assert _equal(target, _module(0).state_dict())


def test_one_directory_saved_again_and_again(tmp_path):
    uri = str(tmp_path / "ckpt")
    for seed in range(3):  # DCP's FileSystemWriter overwrites by default; so does the drop-in writer
        dcp.save(_module(seed).state_dict(), storage_writer=ckptlib.dcp.writer(uri))
        target = _module(9).state_dict()
        dcp.load(target, storage_reader=ckptlib.dcp.reader(uri))
        assert _equal(target, _module(seed).state_dict())
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_module(5).state_dict(), storage_writer=ckptlib.dcp.writer(uri, overwrite=False))
    assert isinstance(_inner(caught.value), ckptlib.CheckpointExistsError)
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")  # a file ckptlib did not write: never removed
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_module(5).state_dict(), storage_writer=ckptlib.dcp.writer(uri))
    assert isinstance(_inner(caught.value), ckptlib.OverwriteRefusedError)
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"
    target = _module(9).state_dict()
    dcp.load(target, storage_reader=ckptlib.dcp.reader(uri))
    assert _equal(target, _module(2).state_dict())


def test_checkpoint_id_resets_storage_and_records_save_and_load_ids(tmp_path):
    writer, reader = ckptlib.dcp.writer(), ckptlib.dcp.reader()
    first = dcp.save(_module(0).state_dict(), storage_writer=writer, checkpoint_id=str(tmp_path / "a"))
    second = dcp.save(_module(1).state_dict(), storage_writer=writer, checkpoint_id=tmp_path / "b")
    assert first.storage_meta.save_id != second.storage_meta.save_id
    assert writer.checkpoint_id == str(tmp_path / "b")
    for name, seed, meta in (("a", 0, first), ("b", 1, second)):
        target = _module(7).state_dict()
        dcp.load(target, storage_reader=reader, checkpoint_id=str(tmp_path / name))
        assert _equal(target, _module(seed).state_dict())
        on_disk = ckptlib.dcp.reader(str(tmp_path / name)).read_metadata().storage_meta
        assert on_disk.save_id == meta.storage_meta.save_id and on_disk.checkpoint_id == str(tmp_path / name)
    ids = set()
    for _ in range(2):
        reader.reset(str(tmp_path / "a"))
        ids.add(reader.read_metadata().storage_meta.load_id)
    assert len(ids) == 2 and None not in ids
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_module(0).state_dict(), storage_writer=ckptlib.dcp.writer())
    assert "has no checkpoint location" in str(_inner(caught.value))


@pytest.mark.parametrize(
    "checkpoint_id,served",
    [
        ("/some/dir", True),
        ("relative/dir", True),
        ("file:///abs/dir", True),
        ("file://otherhost/dir", False),
        ("s3://bucket/prefix", True),
        ("gs://bucket/prefix", True),
        ("az://container/prefix", True),
        ("s3://", False),
        ("hf://org/model", False),
        ("http://host/x", False),
        ("", False),
        (None, False),
        (3, False),
    ],
)
def test_validate_checkpoint_id_accepts_only_what_it_serves(checkpoint_id, served):
    assert ckptlib.dcp.Writer.validate_checkpoint_id(checkpoint_id) is served
    assert ckptlib.dcp.Reader.validate_checkpoint_id(checkpoint_id) is served


def test_writer_and_reader_pickle(tmp_path):
    writer = pickle.loads(pickle.dumps(ckptlib.dcp.writer(str(tmp_path / "c"), step=4, metadata={"run": "r"})))
    dcp.save(_module(0).state_dict(), storage_writer=writer)
    reader = pickle.loads(pickle.dumps(ckptlib.dcp.reader(str(tmp_path / "c"))))
    target = _module(1).state_dict()
    dcp.load(target, storage_reader=reader)
    assert _equal(target, _module(0).state_dict())
    result = ckptlib.load(str(tmp_path / "c"), _module(2).state_dict())
    assert result.step == 4 and result.metadata == {"run": "r"} and result.format == "ckptlib"


def test_reader_refuses_unsafe_pickles_whatever_the_planner(tmp_path):
    uri = str(tmp_path / "c")
    dcp.save({"obj": {"when": __import__("datetime").timedelta(seconds=3)}}, checkpoint_id=uri)
    target = {"obj": {"when": None}}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(target, storage_reader=ckptlib.dcp.reader(uri), planner=dcp.DefaultLoadPlanner())
    error = _inner(caught.value)
    assert isinstance(error, ckptlib.UnsafeCheckpointError) and "datetime.timedelta" in str(error)
    assert target == {"obj": {"when": None}}
    dcp.load(target, storage_reader=ckptlib.dcp.reader(uri, trusted=True))
    assert target["obj"]["when"].total_seconds() == 3


def test_reader_errors_are_ckptlib_errors_inside_dcp_exceptions(tmp_path):
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(2)}, storage_reader=ckptlib.dcp.reader(str(tmp_path / "nowhere")))
    assert isinstance(_inner(caught.value), ckptlib.CheckpointNotFoundError)
    uri = tmp_path / "c"
    dcp.save({"w": torch.arange(64.0)}, storage_writer=ckptlib.dcp.writer(str(uri)))
    shard = uri / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(64)}, storage_reader=ckptlib.dcp.reader(str(uri)))
    assert isinstance(_inner(caught.value), ckptlib.CheckpointCorruptError)
    (uri / MANIFEST_NAME).unlink()  # a save that never committed
    (uri / PENDING_NAME).write_text("{}")
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"w": torch.zeros(64)}, storage_reader=ckptlib.dcp.reader(str(uri)))
    assert isinstance(_inner(caught.value), ckptlib.CheckpointIncompleteError)


def test_rank_local_metadata_mode_is_refused(tmp_path):
    # without collectives DCP runs the steps itself, so the error comes as it is
    with pytest.raises(ckptlib.UnsupportedError, match="needs DCP's collectives"):
        dcp.save({"w": torch.ones(2)}, storage_writer=ckptlib.dcp.writer(str(tmp_path / "c")), use_collectives=False)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------- several ranks


def _dtensor(full: torch.Tensor, placements: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return distribute_tensor(full, mesh, {"row": [Shard(0)], "col": [Shard(1)], "rep": [Replicate()]}[placements])


def _full(seed: int) -> torch.Tensor:
    return torch.randn(13, 7, generator=torch.Generator().manual_seed(seed))


def _save_sharded(uri: str, placements: str) -> None:
    state = {"w": _dtensor(_full(0), placements), "v": _dtensor(_full(1), "rep"), "step": 11}
    dcp.save(state, storage_writer=ckptlib.dcp.writer(), checkpoint_id=uri)


def _load_sharded(uri: str, placements: str) -> list:
    state = {"w": _dtensor(torch.zeros(13, 7), placements), "v": _dtensor(torch.zeros(13, 7), "row"), "step": 0}
    dcp.load(state, storage_reader=ckptlib.dcp.reader(uri))
    return [
        torch.equal(state["w"].full_tensor(), _full(0)),
        torch.equal(state["v"].full_tensor(), _full(1)),
        state["step"],
    ]


@pytest.mark.parametrize(
    "save,load",
    [((2, "row"), (3, "col")), ((3, "col"), (2, "row"))],
    ids=["save2-row-load3-col", "save3-col-load2-row"],
)
def test_dtensors_reshard_across_world_sizes_and_placements(tmp_path, dist_run, save, load):
    uri = str(tmp_path / "ckpt")
    dist_run(save[0], _save_sharded, uri, save[1])
    assert verify(uri) == [] and ckptlib.load(uri, {"step": 0}).world_size == save[0]
    assert dist_run(load[0], _load_sharded, uri, load[1]) == [[True, True, 11]] * load[0]


class _FullDisk(LocalStorage):
    """Local storage whose shard writes fail on rank 1 (a full disk)."""

    def open_writer(self, path: str):
        if dist.get_rank() == 1 and path.endswith(".distcp"):
            raise ckptlib.StorageError(f"{self.uri}/{path}: no space left on device", path=path) from OSError(
                errno.ENOSPC, "No space left on device"
            )
        return super().open_writer(path)


def _failing_save(uri: str) -> str:
    state = {"w": _dtensor(_full(0), "row")}
    try:
        dcp.save(state, storage_writer=ckptlib.dcp.writer(_FullDisk(uri)))
    except CheckpointException as exc:
        error = _inner(exc)
        return f"{type(error).__name__} rank={error.rank}: {error}"
    return "saved"


def test_a_failed_save_is_removed_and_named_on_every_rank(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    outcomes = dist_run(3, _failing_save, uri)
    assert outcomes == [f"StorageError rank=1: {uri}/__1_0.distcp: no space left on device"] * 3
    assert not os.path.exists(uri) or os.listdir(uri) == []
    dist_run(2, _save_sharded, uri, "row")  # the next save there succeeds
    assert dist_run(2, _load_sharded, uri, "row") == [[True, True, 11]] * 2


def _async_save(uri: str, kind: str) -> list:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"w": _dtensor(_full(0), "row"), "v": _dtensor(_full(1), "rep"), "step": 11}
    future = dcp.async_save(
        state,
        storage_writer=ckptlib.dcp.writer(),
        checkpoint_id=uri,
        async_checkpointer_type=AsyncCheckpointerType[kind],
    )
    getattr(future, "upload_completion", future).result(timeout=120)
    return _load_sharded(uri, "col")


@pytest.mark.parametrize("kind,world", [("THREAD", 2), ("PROCESS", 1)], ids=["thread-ws2", "process-ws1"])
def test_async_save_on_both_executors(tmp_path, dist_run, kind, world):
    uri = str(tmp_path / "ckpt")
    assert dist_run(world, _async_save, uri, kind, timeout=240) == [[True, True, 11]] * world
    assert verify(uri) == []
