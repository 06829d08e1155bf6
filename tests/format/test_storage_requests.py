"""Storage calls of opening a checkpoint and preparing a save target: each is a request on
object stores, and `.metadata` grows as ranks x tensors, so it is read once, not twice.
(The S3 request counts of whole saves and loads: `python -m benchmarks.s3_requests`.)"""

from __future__ import annotations

import collections

import pytest
import torch

import ckptlib
from ckptlib.errors import CheckpointCorruptError
from ckptlib.format import METADATA_NAME, open_checkpoint, prepare_save_target
from ckptlib.storage import as_storage


class CountingStorage:
    """Delegates to a Storage and counts (method, first argument) of every call."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: collections.Counter = collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[(name, args[0] if args and isinstance(args[0], str) else None)] += 1
            return attr(*args, **kwargs)

        return counted


def _saved(tmp_path) -> str:
    uri = str(tmp_path / "ckpt")
    ckptlib.save(uri, {"w": torch.arange(12.0).reshape(3, 4), "epoch": 3})
    return uri


def test_open_reads_metadata_once(tmp_path):
    storage = CountingStorage(as_storage(_saved(tmp_path)))
    info = open_checkpoint(storage)
    assert sorted(info.metadata.state_dict_metadata) == ["epoch", "w"]
    assert storage.calls[("read", METADATA_NAME)] == 1
    assert storage.calls[("exists", None)] == 1


@pytest.mark.parametrize("change", ["grown", "shrunk"])
def test_metadata_of_another_size_than_recorded_is_still_refused(tmp_path, change):
    uri = _saved(tmp_path)
    path = tmp_path / "ckpt" / METADATA_NAME
    blob = path.read_bytes()
    path.write_bytes(blob + b"x" if change == "grown" else blob[:-1])
    with pytest.raises(CheckpointCorruptError, match="files do not match the manifest"):
        open_checkpoint(as_storage(uri))
    with pytest.raises(CheckpointCorruptError, match=r"checksum mismatch \(size %d vs %d" % (
        len(blob) + (1 if change == "grown" else -1), len(blob)
    )):
        open_checkpoint(as_storage(uri), check_files=False)


def test_preparing_a_fresh_target_asks_once_whether_it_exists(tmp_path):
    storage = CountingStorage(as_storage(str(tmp_path / "fresh")))
    prepare_save_target(storage, overwrite=False, world_size=2)
    assert storage.calls[("exists", None)] == 1
    assert storage.calls[("list", None)] == 0
    assert sorted(as_storage(str(tmp_path / "fresh")).list()) == ["ckptlib.pending"]
