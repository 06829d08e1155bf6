"""The writer's item encoder: torch.save's exact bytes with one CRC pass (format/item_encoder.py), and
the zip records it and the reader locate (format/zip_directory.py).

Every case compares against torch.save itself, byte for byte, and against zlib's CRC-32;
the fallback (plain torch.save) must write identical shard files.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
import zlib

import numpy as np
import pytest
import torch

import ckptlib
from ckptlib._torch import serialization
from ckptlib.format.items import checksum, item_encoder, zip_directory
from ckptlib.format.native.layout import read_manifest
from ckptlib.storage import open_storage

# Only a missing zlib-ng turns the fast path off legitimately; anything else fails below.
pytestmark = pytest.mark.skipif(not checksum.FAST, reason="zlib-ng is not installed")


def test_fast_path_is_on():
    assert item_encoder.fast_path_reason() is None


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int64,
    torch.bool,
    torch.complex64,
]
SHAPES = {"scalar": (), "empty": (0,), "empty2d": (0, 5), "small": (7, 3), "view-sized": (300, 257), "1d": (100_003,)}


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    values = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.complex64:
        return torch.complex(values.float(), -values.float())
    return values.to(dtype)


def _torch_save_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_bytes_and_crc_equal_torch_save(dtype, shape):
    tensor = _tensor(dtype, shape)
    item = item_encoder.encode(tensor)
    assert item is not None
    got = b"".join(bytes(c) for c in item.chunks)
    assert got == _torch_save_bytes(tensor)
    assert item.size == len(got)
    assert item.crc == zlib.crc32(got)
    # Every zip CRC is right (zipfile checks them on read), and torch.load round-trips it.
    with zipfile.ZipFile(io.BytesIO(got)) as archive:
        assert archive.testzip() is None
    assert torch.equal(torch.load(io.BytesIO(got), weights_only=True), tensor)


def test_data_record_is_not_copied():
    """The tensor's bytes are handed over as views of its memory, back to back, in pieces of
    at most 1 MiB cut at the file's MiB boundaries (the item starts at file offset 5000)."""
    tensor = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB
    item = item_encoder.encode(tensor, base=5000, block_size=1 << 20)
    views = [c for c in item.chunks if c.readonly]
    addresses = [np.frombuffer(c, dtype=np.uint8).ctypes.data for c in views]
    assert addresses[0] == tensor.data_ptr() and sum(c.nbytes for c in views) == 3 << 20
    assert all(a + c.nbytes == b for a, c, b in zip(addresses, views, addresses[1:]))
    assert len(views) == 4 and max(c.nbytes for c in views) <= 1 << 20
    starts = np.cumsum([0] + [c.nbytes for c in item.chunks])[:-1] + 5000
    view_starts = [int(st) for st, c in zip(starts, item.chunks) if c.readonly]
    assert all(st % (1 << 20) == 0 for st in view_starts[1:])


def test_leaves_torch_global_crc_option_alone():
    before = torch.serialization.get_crc32_options() if hasattr(torch.serialization, "get_crc32_options") else None
    item_encoder.encode(torch.ones(10))
    after = torch.serialization.get_crc32_options() if hasattr(torch.serialization, "get_crc32_options") else None
    assert before == after


def test_unrecognised_archive_falls_back(monkeypatch):
    def compressed_archive(obj, buffer):
        data = io.BytesIO()
        with zipfile.ZipFile(data, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("archive/data.pkl", b"x" * 100)
        buffer.write(data.getvalue())
        return True

    monkeypatch.setattr(serialization, "torch_save_without_zip_crc", compressed_archive)
    assert item_encoder._encode(torch.ones(3)) is None


def test_probe_turns_the_fast_path_off_when_bytes_differ(monkeypatch):
    monkeypatch.setattr(item_encoder, "_hash_combine", lambda seed, value: seed ^ value)
    item_encoder.fast_path_reason.cache_clear()
    try:
        reason = item_encoder.fast_path_reason()
        assert reason == f"the encoding differs from torch.save's on this torch ({torch.__version__})"
        assert item_encoder.encode(torch.ones(3)) is None
    finally:
        monkeypatch.undo()
        item_encoder.fast_path_reason.cache_clear()
    assert item_encoder.fast_path_reason() is None


def test_probe_needs_zlib_ng(monkeypatch):
    monkeypatch.setattr(item_encoder, "FAST", False)
    item_encoder.fast_path_reason.cache_clear()
    try:
        assert item_encoder.fast_path_reason().startswith("zlib-ng is not installed")
    finally:
        monkeypatch.undo()
        item_encoder.fast_path_reason.cache_clear()


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(513, 129, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "e": torch.zeros(0, 4),
        "view": torch.randn(40, 40, generator=g)[::2, 1:],  # non-contiguous: saved as a copy
        "step": 11,
    }


def _shard_files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.endswith(".distcp")}


def test_fast_and_fallback_writers_write_identical_shards(tmp_path, monkeypatch):
    ckptlib.save(tmp_path / "fast", _state())
    monkeypatch.setattr(item_encoder, "encode", lambda *args: None)
    ckptlib.save(tmp_path / "fallback", _state())
    fast, fallback = _shard_files(tmp_path / "fast"), _shard_files(tmp_path / "fallback")
    assert list(fast) == ["__0_0.distcp"]
    assert fast == fallback
    manifests = [read_manifest(open_storage(str(tmp_path / d))) for d in ("fast", "fallback")]
    assert manifests[0].files["__0_0.distcp"] == manifests[1].files["__0_0.distcp"]


def test_zlib_ng_and_zlib_agree():
    data = os.urandom(1 << 20)
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32_combine(zlib.crc32(data[:1000]), zlib.crc32(data[1000:]), len(data) - 1000) == zlib.crc32(
        data
    )


def _central_directory(archive: bytes) -> tuple[int, int]:
    """(size, offset) of a zip archive's central directory, from its classic end record."""
    return struct.unpack_from("<II", archive, len(archive) - 22 + 12)


def _reader(blob: bytes):
    def read(pos, n):
        if pos < 0 or pos + n > len(blob):
            raise EOFError(pos)
        return blob[pos : pos + n]

    return read


@pytest.mark.parametrize("shape", [(1000, 3), (0,), ()], ids=["matrix", "empty", "scalar"])
def test_tensor_data_record_finds_the_raw_bytes(shape):
    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blob = _torch_save_bytes(tensor)
    record = zip_directory.tensor_data_record(_reader(blob), len(blob))
    assert record.size == tensor.numel() * 4
    assert blob[record.start : record.start + record.size] == tensor.numpy().tobytes()
    # what located the data: the record's local header, and everything from the central directory on
    (header_lo, header_hi), (tail_lo, tail_hi) = record.parsed
    assert header_hi == record.start and blob[header_lo : header_lo + 4] == b"PK\x03\x04"
    assert tail_hi == len(blob) and blob[tail_lo : tail_lo + 4] == b"PK\x01\x02"


def test_tensor_data_record_refuses_what_it_cannot_read_directly():
    two = _torch_save_bytes({"a": torch.ones(3), "b": torch.zeros(2)})  # two data records
    assert zip_directory.tensor_data_record(_reader(two), len(two)) is None
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data/0", b"\0" * 400)
    blob = deflated.getvalue()
    assert zip_directory.tensor_data_record(_reader(blob), len(blob)) is None
    assert zip_directory.tensor_data_record(_reader(b"not a zip at all, not at all" * 3), 84) is None
    # a central record whose signature is damaged: never parsed (tensor_pickle neither)
    archive = _torch_save_bytes(torch.arange(4.0))
    damaged = bytearray(archive)
    damaged[_central_directory(archive)[1]] ^= 0xFF
    damaged = bytes(damaged)
    assert zip_directory.tensor_data_record(_reader(damaged), len(damaged)) is None
    assert zip_directory.tensor_pickle(_reader(damaged), len(damaged)) is None
    # an archive without a data.pkl has no header to read
    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w", compression=zipfile.ZIP_STORED) as out:
        out.writestr("archive/data/0", b"\0" * 16)
    assert zip_directory.tensor_pickle(_reader(plain.getvalue()), len(plain.getvalue())) is None


@pytest.mark.parametrize(
    "nbytes",
    [0, 4, item_encoder.SMALL_ITEM_BYTES - 4, item_encoder.SMALL_ITEM_BYTES],
    ids=["empty", "tiny", "just-small", "threshold"],
)
def test_small_and_encoded_items_are_torch_save_bytes(tmp_path, monkeypatch, nbytes):
    """Items either side of the small-item threshold are torch.save's exact bytes, with the
    item CRCs of those bytes, and the encoder runs only for the large ones."""
    encoded = []
    real_encode = item_encoder.encode
    monkeypatch.setattr(item_encoder, "encode", lambda *a: encoded.append(a[0].nbytes) or real_encode(*a))
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(nbytes // 4, generator=g) for i in range(3)}
    ckptlib.save(tmp_path / "c", state)
    assert encoded == ([nbytes] * 3 if nbytes >= item_encoder.SMALL_ITEM_BYTES else [])
    data = _shard_files(tmp_path / "c")["__0_0.distcp"]
    record = read_manifest(open_storage(str(tmp_path / "c"))).files["__0_0.distcp"]
    assert record.crc32 == zlib.crc32(data)
    items = sorted(record.items)
    assert [zlib.crc32(data[o : o + n]) for o, n, _ in items] == [c for _, _, c in items]
    blobs = sorted(bytes(data[o : o + n]) for o, n, _ in items)
    loaded = sorted(torch.load(io.BytesIO(b), weights_only=True).numpy().tobytes() for b in blobs)
    assert loaded == sorted(t.numpy().tobytes() for t in state.values())
    for blob in blobs:
        expected = io.BytesIO()
        torch.save(torch.load(io.BytesIO(blob), weights_only=True), expected)
        assert blob == expected.getvalue()


SMALL_SHAPES = {"scalar": (), "empty": (0,), "small": (7, 3), "3d": (5, 4, 3)}


@pytest.mark.parametrize("shape", SMALL_SHAPES.values(), ids=SMALL_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_small_items_from_a_template_are_torch_save_bytes(dtype, shape):
    """The first tensor of a signature makes its template, the next ones are filled from it:
    both torch.save's exact bytes (data, record CRCs and serialization id differ per tensor)."""
    item_encoder._templates.clear()
    first = _tensor(dtype, shape)
    second = torch.flip(first, [0]).contiguous() if first.dim() else first + 1 if dtype != torch.bool else ~first
    for tensor in (first, second, first):
        assert bytes(item_encoder.small_item_bytes(tensor)) == _torch_save_bytes(tensor)
    made = item_encoder._templates[(dtype, tuple(shape), first.stride(), 0)] if first.numel() else None
    assert (made is not None) == (first.numel() > 0)  # empty tensors always take plain torch.save


def test_small_items_that_are_not_plain_tensors_take_torch_save():
    item_encoder._templates.clear()
    base = torch.arange(6, dtype=torch.float32)
    for tensor in (torch.nn.Parameter(base.clone()), base.clone().requires_grad_()):
        blob = bytes(item_encoder.small_item_bytes(tensor))
        assert blob == _torch_save_bytes(tensor)
    assert item_encoder._templates == {}


@pytest.mark.parametrize("shape", [(80, 80), (3,), ()], ids=["matrix", "vector", "scalar"])
def test_tensor_layout_of_an_item_in_memory(shape):
    from ckptlib.format.items.item_header import pickled_tensor_header

    tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blob = _torch_save_bytes(tensor)
    layout = zip_directory.tensor_layout(memoryview(blob))
    assert blob[layout.data_start : layout.data_start + layout.data_size] == tensor.numpy().tobytes()
    assert pickled_tensor_header(layout.pickle) == (torch.float32, shape, tensor.stride(), 0)


def test_tensor_layout_refuses_what_it_cannot_read_directly():
    two = _torch_save_bytes({"a": torch.ones(3), "b": torch.zeros(2)})  # two data records
    assert zip_directory.tensor_layout(memoryview(two)) is None
    deflated = io.BytesIO()
    with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * 40)
        archive.writestr("archive/data/0", b"\0" * 400)
    assert zip_directory.tensor_layout(memoryview(deflated.getvalue())) is None
    assert zip_directory.tensor_layout(memoryview(b"not a zip at all, not at all" * 3)) is None
    assert zip_directory.tensor_layout(memoryview(b"")) is None
    blob = _torch_save_bytes(torch.ones(3))
    assert zip_directory.tensor_layout(memoryview(blob[:-30])) is None  # cut off: no end record


def test_a_patch_across_captured_pieces_lands_byte_for_byte():
    """A field patched into the captured archive (a CRC, a record id) may straddle two pieces
    and start inside the first: each byte lands once, in order, and the CRCs of the pieces and
    of any range across them follow."""
    pieces = [bytearray(b"aaaa"), bytearray(b"bb"), bytearray(b"cccc")]
    archive = item_encoder._Archive([memoryview(p) for p in pieces], 10)
    assert archive.chunk_crc(1) == zlib.crc32(b"bb")
    archive.patch(3, b"WXYZ")
    assert [bytes(p) for p in pieces] == [b"aaaW", b"XY", b"Zccc"]
    assert archive.read(0, 10) == b"aaaWXYZccc"
    assert archive.chunk_crc(1) == zlib.crc32(b"XY")
    assert archive.crc(3, 7) == zlib.crc32(b"WXYZ") and archive.crc(0, 10) == zlib.crc32(b"aaaWXYZccc")
    assert archive.crc(1, 4) == zlib.crc32(b"aaW") and archive.crc(4, 6) == zlib.crc32(b"XY")


def _with_zip64_sizes(archive: bytes, name: str) -> bytes:
    """`archive` with `name`'s central-directory sizes moved into a zip64 extra field, as a
    writer records an item of 4 GiB or more (0xFFFFFFFF in the 32-bit fields)."""
    cd_size, cd_offset = _central_directory(archive)
    records, pos = [], cd_offset
    while pos < cd_offset + cd_size:
        fixed = bytearray(archive[pos : pos + 46])
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", fixed, 28)
        rest = archive[pos + 46 : pos + 46 + name_len + extra_len + comment_len]
        if rest[:name_len].decode() == name:
            csize, usize = struct.unpack_from("<II", fixed, 20)
            extra = struct.pack("<HHQQ", 1, 16, usize, csize)
            struct.pack_into("<IIH", fixed, 20, 0xFFFFFFFF, 0xFFFFFFFF, name_len)
            struct.pack_into("<H", fixed, 30, extra_len + len(extra))
            rest = rest[:name_len] + extra + rest[name_len:]
        records.append(bytes(fixed) + rest)
        pos += 46 + name_len + extra_len + comment_len
    directory = b"".join(records)
    eocd = bytearray(archive[-22:])
    struct.pack_into("<II", eocd, 12, len(directory), cd_offset)
    return archive[:cd_offset] + directory + bytes(eocd)


def test_zip64_sizes_of_an_item_of_4_gib_are_read_from_their_extra_field():
    """A tensor of 4 GiB or more has its sizes in the zip64 extra field: the record parser
    takes them from there (each 32-bit field that says 0xFFFFFFFF, in order) and finds the
    tensor's bytes, instead of giving up on the fast path."""
    archive = _torch_save_bytes(torch.arange(40, dtype=torch.int32))
    data_name = [n for n in zipfile.ZipFile(io.BytesIO(archive)).namelist() if "/data/" in n][0]
    patched = _with_zip64_sizes(archive, data_name)
    read = _reader(patched)

    plain = {e.name: e for e in zip_directory.central_entries(_reader(archive), len(archive))}
    entries = {e.name: e for e in zip_directory.central_entries(read, len(patched))}
    assert entries[data_name].size == plain[data_name].size == 160
    assert entries[data_name].local_at == plain[data_name].local_at
    record = zip_directory.tensor_data_record(read, len(patched))
    assert record is not None and record.size == 160
    assert patched[record.start : record.start + 160] == torch.arange(40, dtype=torch.int32).numpy().tobytes()


def test_a_record_name_that_is_not_utf8_leaves_the_item_to_torch_load():
    """A torch.save archive whose record names do not decode as UTF-8 is not one the fast
    record parsers know: they give no answer (the reader then decodes the item with
    torch.load), instead of raising UnicodeDecodeError out of a load."""
    archive = bytearray(_torch_save_bytes(torch.arange(4.0)))
    _, cd_offset = _central_directory(archive)
    archive[cd_offset + 46] = 0xFF  # the first byte of the first record's name, in the central directory
    data = bytes(archive)
    assert zip_directory.tensor_pickle(_reader(data), len(data)) is None
    assert zip_directory.tensor_data_record(_reader(data), len(data)) is None


def test_archives_with_and_without_a_zip64_end_record_are_parsed():
    """torch.save ends its archive with a zip64 end record (and locator); other writers write
    only the classic one: the record parser reads the directory through either."""
    with_zip64 = _torch_save_bytes(torch.arange(4.0))
    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w", compression=zipfile.ZIP_STORED) as archive:
        for info in zipfile.ZipFile(io.BytesIO(with_zip64)).infolist():
            archive.writestr(info.filename, zipfile.ZipFile(io.BytesIO(with_zip64)).read(info))
    without = plain.getvalue()
    assert with_zip64[-42:-38] == b"PK\x06\x07" and without[-42:-38] != b"PK\x06\x07"

    def entries(data: bytes) -> list[tuple[str, int]]:
        return [(e.name, e.size) for e in zip_directory.central_entries(_reader(data), len(data))]

    expected = [(info.filename, info.file_size) for info in zipfile.ZipFile(io.BytesIO(with_zip64)).infolist()]
    assert entries(with_zip64) == expected and entries(without) == expected


def test_an_archive_without_a_data_record_has_no_fast_layout():
    """tensor_layout (the layout of a whole item read into memory) wants exactly one data.pkl
    and one data record: an archive with only a data.pkl is left to torch.load (None)."""
    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w", compression=zipfile.ZIP_STORED) as out:
        out.writestr("archive/data.pkl", b"\x80\x02K\x01.")
    assert zip_directory.tensor_layout(memoryview(plain.getvalue())) is None


def test_a_tensor_signature_without_a_template_is_written_by_torch_save(monkeypatch):
    """A small tensor whose torch.save bytes give no fillable template (the encoder cannot
    reproduce them) is written by torch.save every time, and loads back as itself."""
    monkeypatch.setattr(item_encoder, "_template_for", lambda *args: None)
    monkeypatch.setattr(item_encoder, "_templates", {})
    tensor = torch.arange(5.0)
    for _ in range(2):  # the first call finds no template, the second finds "none possible"
        written = bytes(item_encoder.small_item_bytes(tensor))
        assert torch.equal(torch.load(io.BytesIO(written), weights_only=True), tensor)
