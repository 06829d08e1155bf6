"""Storage calls of opening a checkpoint and preparing a save target: each is a request on
object stores, and `.metadata` grows as ranks x tensors, so it is read once, not twice.
(The S3 request counts of whole saves and loads: `python -m ckptlib.bench.s3_requests`.)"""

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
    with pytest.raises(
        CheckpointCorruptError,
        match=r"checksum mismatch \(size %d vs %d" % (len(blob) + (1 if change == "grown" else -1), len(blob)),
    ):
        open_checkpoint(as_storage(uri), check_files=False)


def test_preparing_a_fresh_target_asks_once_whether_it_exists(tmp_path):
    storage = CountingStorage(as_storage(str(tmp_path / "fresh")))
    prepare_save_target(storage, overwrite=False, world_size=2)
    assert storage.calls[("exists", None)] == 1
    assert storage.calls[("list", None)] == 0
    assert sorted(as_storage(str(tmp_path / "fresh")).list()) == ["ckptlib.pending"]


_GAP = 1 << 20  # ranged_io._COALESCE_GAP


@pytest.mark.parametrize(
    "spans,max_span,expected",
    [
        ([(0, 10), (10, 10), (20, 10)], 20, [(0, 20), (20, 10)]),
        ([(100, 10), (110, 10), (120, 10)], 20, [(100, 20), (120, 10)]),
        ([(0, 50), (50, 5)], 20, [(0, 50), (50, 5)]),
        ([(20, 10), (0, 10)], None, [(0, 30)]),
        ([(0, 10), (10 + _GAP, 10)], None, [(0, 20 + _GAP)]),
        ([(0, 10), (11 + _GAP, 10)], None, [(0, 10), (11 + _GAP, 10)]),
        ([(0, 10), (11 + _GAP, 100), (111 + 2 * _GAP, 5)], None, [(0, 10), (11 + _GAP, 105 + _GAP)]),
    ],
    ids=[
        "at-most-max-span",
        "at-an-offset",
        "a-larger-item-alone",
        "sorted",
        "gap-at-limit",
        "gap-past-limit",
        "gap-after-the-last-span",
    ],
)
def test_reads_coalesce_across_small_gaps_up_to_their_span(spans, max_span, expected):
    """Shard reads are merged into one ranged read across gaps of up to 1 MiB, and never grow
    past `max_span` bytes (one item larger than that is read alone): the memory a read holds."""
    from ckptlib.format.items.ranged_io import _COALESCE_GAP, _coalesce

    assert _COALESCE_GAP == _GAP
    assert _coalesce(spans, max_span=max_span) == expected


def _file_reader(data: bytes, calls: list):
    def read_into(view: memoryview, offset: int) -> int:
        calls.append((offset, view.nbytes))
        got = data[offset : offset + view.nbytes]
        view[: len(got)] = got
        return len(got)

    return read_into


def test_an_items_tail_is_read_once_and_reads_stay_inside_the_item():
    """The record parsers read an item's zip directory from its tail: one read of the last 4 KiB
    up front serves every read inside it (up to its very last byte), a read before it is its
    own, and a read outside the item is an EOFError, never bytes of the next item."""
    from ckptlib.format.items.ranged_io import _TAIL, _cached_tail_reader

    data = bytes(range(256)) * 40  # a 10,240-byte file; the item is [100, 100 + 8000)
    calls: list = []
    read = _cached_tail_reader(_file_reader(data, calls), 100, 8000)
    assert calls == [(100 + 8000 - _TAIL, _TAIL)]
    assert read(8000 - 10, 10) == data[100 + 7990 : 100 + 8000] and read(8000 - _TAIL, 4) == data[4004:4008]
    assert len(calls) == 1
    assert read(5, 3) == data[105:108] and calls[-1] == (105, 3)
    for pos, n in [(7999, 2), (8000, 1), (-1, 1), (0, -1)]:
        with pytest.raises(EOFError, match=r"lie outside the item \(8000 bytes\)"):
            read(pos, n)


def test_a_verified_read_that_meets_the_end_of_the_file_is_an_eof_error():
    """Feeding a block check the bytes around a row range stops with EOFError when the file
    ends early (a read returns nothing), instead of asking again forever."""
    from ckptlib.format.read.dcp_reader import CkptReader

    reader = object.__new__(CkptReader)
    reader.bytes_read = 0
    fed = []

    class Check:
        def feed(self, chunk):
            fed.append(bytes(chunk))

    with pytest.raises(EOFError, match="short read at offset 6"):
        reader._feed_range(_file_reader(b"abcdef", []), 2, 10, Check(), chunk=3)
    assert fed == [b"cde", b"f"] and reader.bytes_read == 4
