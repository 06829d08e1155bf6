"""A stored tensor item decoded without torch.load, trusted only where the item's own header
says what `.metadata` declares.

torch.load costs ~1 ms an item (most of a load of small tensors); a metadata-only torch.load of
a large one as much. `DeclaredChunks` instead parses the item's zip directory (`zip_directory`)
and its pickled header (`item_header`) and checks them against the chunk `.metadata` declares:
a transposed shape or another dtype of the same byte size would otherwise read intact bytes
as the wrong tensor. Anything it does not recognise is left to torch.load, which decodes it
or reports what is wrong with it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptlib.format.items import zip_directory
from ckptlib.format.items.item_header import pickled_tensor_header
from ckptlib.format.items.ranged_io import ReadInto, _cached_tail_reader


class DeclaredChunks:
    """What `.metadata` declares about each stored tensor chunk (dtype and size), and the two
    decodings that rely on it: a large item's data record located in place, a small item held
    in memory as a tensor over its bytes."""

    def __init__(self, metadata: Metadata):
        self.metadata = metadata
        self._chunks: dict[str, tuple[torch.dtype, dict[tuple, tuple[int, ...]]] | None] = {}
        self._headers: dict[bytes, Any] = {}

    def declared(self, fqn: str, offsets) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """dtype and size of the stored chunk of `fqn` at `offsets`, from `.metadata`."""
        cache = self._chunks
        if fqn not in cache:
            md = self.metadata.state_dict_metadata.get(fqn)
            chunks = getattr(md, "chunks", None)
            if chunks is None:
                cache[fqn] = None
            else:
                cache[fqn] = (md.properties.dtype, {tuple(c.offsets): tuple(c.sizes) for c in chunks})
        found = cache[fqn]
        if found is None:
            return None
        sizes = found[1].get(tuple(offsets))
        return None if sizes is None else (found[0], sizes)

    def ckptlib_layout(self, read_into: ReadInto, info, req) -> tuple[torch.Tensor, int, list] | None:
        """(meta tensor, offset of its data record in the item, the item ranges whose bytes
        said so) without unpickling anything.

        CkptWriter saves every tensor item contiguous and with its own storage, so shape and
        dtype are those of the chunk in `.metadata`, and the data is the item's only
        `*/data/<key>` zip record, which must be stored uncompressed and exactly that large.
        Anything else: None, and the caller decodes the item's header with torch.load (a
        metadata-only load costs ~1 ms an item, this two reads and ~30 us)."""
        found = self.declared(req.storage_index.fqn, req.storage_index.offset)
        if found is None:
            return None
        dtype, sizes = found
        read = _cached_tail_reader(read_into, info.offset, info.length)
        record = zip_directory.tensor_data_record(read, info.length)
        meta = torch.empty(sizes, dtype=dtype, device="meta")
        if record is None or record.size != meta.numel() * meta.element_size():
            return None
        # The item's own header must say what .metadata says: a transposed shape or another
        # dtype of the same byte size would otherwise read intact bytes as the wrong tensor.
        if pickled_tensor_header(zip_directory.tensor_pickle(read, info.length)) != (
            dtype,
            tuple(sizes),
            meta.stride(),
            0,
        ):
            return None  # the caller decodes the header with torch.load and reports the mismatch
        return meta, record.start, record.parsed

    def decode_plain(self, req, data: memoryview) -> torch.Tensor | None:
        """The stored chunk of a whole in-memory item as a tensor over its bytes, without
        torch.load, when the item is a plain contiguous tensor whose own header says what
        `.metadata` declares; None otherwise (torch.load then decodes it, or reports it).
        torch.load costs ~1 ms an item: most of the time of a load of small tensors."""
        declared = self.declared(req.storage_index.fqn, req.storage_index.offset)
        if declared is None or sys.byteorder != "little":  # torch.save writes native order; ours is little-endian
            return None
        dtype, sizes = declared
        layout = zip_directory.tensor_layout(data)
        if layout is None:
            return None
        headers = self._headers
        if layout.pickle not in headers:
            headers[layout.pickle] = pickled_tensor_header(layout.pickle)
        strides, step = [], 1
        for n in reversed(sizes):
            strides.insert(0, step)
            step *= n
        nbytes = step * dtype.itemsize
        if (
            headers[layout.pickle] != (dtype, tuple(sizes), tuple(strides), 0)
            or layout.data_size != nbytes
            or not nbytes
        ):
            return None
        raw = data[layout.data_start : layout.data_start + nbytes]
        return torch.frombuffer(bytearray(raw) if raw.readonly else raw, dtype=dtype).view(sizes)
