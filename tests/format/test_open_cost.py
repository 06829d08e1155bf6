"""Rank 0's open for a load at scale (issue 25.5): the checkpoint info it broadcasts pickles as
the verified bytes it read (the other ranks parse them, rank 0 does not pickle the Metadata
again), and the structure check remembers the layouts that tile their tensors without ever
skipping a tensor's own storage records."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptlib
from ckptlib.format.native.layout import open_checkpoint
from ckptlib.format.native.structure import structure_problems
from ckptlib.storage import as_storage


def _files(path) -> tuple[bytes, bytes]:
    return tuple(open(os.path.join(path, name), "rb").read() for name in ("ckptlib.json", ".metadata"))  # type: ignore[return-value]


def test_the_broadcast_info_is_the_verified_bytes_and_parses_to_the_same_info(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.arange(6.0).reshape(2, 3), "step": 3, "nested": {"b": torch.ones(2)}})
    info = open_checkpoint(as_storage(tmp_path / "c"))
    rebuild, args = info.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    assert args[2:] == _files(tmp_path / "c")  # the files themselves, not a pickle of what they hold
    sent = pickle.loads(pickle.dumps(info))
    assert sent == info and pickle.dumps(sent.metadata) == pickle.dumps(info.metadata)
    assert sent.world_size == info.world_size == 1 and sent.step is None


def test_an_info_whose_records_were_replaced_pickles_them(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.zeros(2)})
    info = open_checkpoint(as_storage(tmp_path / "c"))
    info.metadata = Metadata(state_dict_metadata={})
    assert pickle.loads(pickle.dumps(info)).metadata == info.metadata


def _tensor(size, chunks) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


class _Info:
    def __init__(self, length=1024):
        self.relative_path, self.offset, self.length = "__0_0.distcp", 0, length


ROWS = [((0, 0), (2, 4)), ((2, 0), (2, 4))]


@pytest.mark.parametrize("exhaustive", [False, True], ids=["load", "verify"])
def test_tensors_sharing_a_layout_still_have_their_own_records_checked(exhaustive):
    tensors = {f"t{i}": _tensor((4, 4), ROWS) for i in range(4)}
    tensors["t4"] = _tensor((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))])  # the same shape, overlapping
    storage = {MetadataIndex(fqn, torch.Size(o)): _Info() for fqn in tensors for o, _ in ROWS}
    del storage[MetadataIndex("t2", torch.Size((2, 0)))]  # a record missing after two good tensors
    storage[MetadataIndex("t3", torch.Size((0, 0)))] = _Info(length=16)  # too short for 8 floats
    storage[MetadataIndex("t4", torch.Size((0, 0)))] = _Info()
    problems = structure_problems(
        Metadata(tensors, storage_data=storage), None, {"__0_0.distcp": 1024}, exhaustive=exhaustive
    )
    texts = [p.message for p in problems]
    assert texts[:2] == [
        "tensor 't2': chunk at offsets [2, 0] has no storage record",
        "tensor 't3': chunk at offsets [0, 0] with sizes [2, 4] needs 32 bytes, but its stored item holds 16",
    ]
    overlap = "(chunks overlap)" if not exhaustive else "overlap"
    assert len(texts) == 3 and texts[2].startswith("tensor 't4' of shape [4, 4]") and overlap in texts[2]
