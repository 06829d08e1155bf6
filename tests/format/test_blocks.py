"""Block checksums: the writer records a CRC-32 per fixed-size block of every shard file, and
a resharded verified load reads (and verifies) only the blocks covering the rows it needs.

The block size is shrunk to 4 KiB here so a small state spans many blocks; every number
below is computed from the file or the manifest, never assumed.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import zlib

import pytest
import torch
from helpers.readers import IntoTensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import ckptlib
from ckptlib import cli
from ckptlib.errors import CheckpointCorruptError
from ckptlib.format.items import block_checks, checksum, item_encoder, zip_directory
from ckptlib.format.native.manifest import FileRecord
from ckptlib.format.read import dcp_reader
from ckptlib.format.source import open_reader
from ckptlib.format.write import dcp_writer
from ckptlib.storage import open_storage

pytestmark = pytest.mark.skipif(not checksum.FAST, reason="block checksums need zlib-ng's crc32_combine")

BLOCK = 4096
ROWS, COLS = 1024, 512  # 2 MiB of float32: read through the direct path (>= 1 MiB)


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(block_checks, "_MIN_BLOCK", BLOCK)


def _weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1))


def _state() -> dict:
    g = torch.Generator().manual_seed(2)
    return {"w": _weight(), "b": torch.randn(777, generator=g).to(torch.bfloat16), "n": 4}


def _manifest(path) -> dict:
    return json.loads((path / "ckptlib.json").read_text())


@pytest.mark.parametrize("writer", ["encoder", "torch.save"])
def test_block_crcs_match_the_file(tmp_path, small_blocks, monkeypatch, writer):
    if writer == "torch.save":
        monkeypatch.setattr(item_encoder, "encode", lambda *args: None)
    ckptlib.save(tmp_path / "c", _state())
    record = _manifest(tmp_path / "c")["files"]["__0_0.distcp"]
    data = (tmp_path / "c" / "__0_0.distcp").read_bytes()
    assert record["size"] == len(data) and record["blocks"]["size"] == BLOCK
    expected = [zlib.crc32(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]
    assert record["blocks"]["crc32"] == expected
    assert record["crc32"] == zlib.crc32(data)
    assert [zlib.crc32(data[o : o + n]) for o, n, _ in record["items"]] == [c for _, _, c in record["items"]]


@pytest.mark.parametrize(
    "planned, size",
    [(0, 1 << 20), (1 << 30, 1 << 20), ((1 << 30) + 1, 2 << 20), (1 << 40, 1 << 30)],
    ids=["empty", "1GiB", "1GiB+1", "1TiB"],
)
def test_block_size_keeps_the_manifest_small(planned, size):
    assert block_checks.block_size_for(planned) == size
    assert -(-planned // size) <= 1024


def _read_rows(path, first: int, count: int, verify: bool = True):
    """What a rank of a resharded load does: read rows [first, first + count) of `w`."""
    reader, info = open_reader(open_storage(str(path)), verify=verify)
    md = info.metadata.state_dict_metadata["w"]
    want = ChunkStorageMetadata(offsets=torch.Size([first, 0]), sizes=torch.Size([count, COLS]))
    out = torch.zeros(count, COLS)
    reader.read_data(LoadPlan(create_read_items_for_chunk_list("w", md, [want])), IntoTensor(out)).wait()
    return out, reader.bytes_read, info


def _data_start(path, info) -> int:
    """File offset of `w`'s raw bytes (its zip data record) in the shard."""
    storage = info.metadata.storage_data
    (entry,) = [v for k, v in storage.items() if k.fqn == "w"]
    data = (path / entry.relative_path).read_bytes()[entry.offset : entry.offset + entry.length]
    raw = _weight().numpy().tobytes()
    return entry.offset + data.index(raw[:4096])


def _verified_bytes(path, info, first: int, count: int) -> int:
    """What a verified read of rows [first, first + count) of `w` must read: the blocks that
    cover those rows, the data record's local header, and the zip directory at the item's
    end (the bytes that located the rows), each rounded out to blocks, overlaps once."""
    (entry,) = [v for k, v in info.metadata.storage_data.items() if k.fqn == "w"]
    item = (path / entry.relative_path).read_bytes()[entry.offset : entry.offset + entry.length]
    record = zip_directory.tensor_data_record(lambda pos, n: item[pos : pos + n], len(item))
    rows = (record.start + first * COLS * 4, record.start + (first + count) * COLS * 4)
    covered: set[int] = set()
    for lo, hi in [rows, *record.parsed]:
        covered |= set(range((entry.offset + lo) // BLOCK, -(-(entry.offset + hi) // BLOCK)))
    return len(covered) * BLOCK  # (no short last block involved: the item ends before the file does)


def test_resharded_verified_read_touches_only_covering_blocks(tmp_path, small_blocks):
    ckptlib.save(tmp_path / "c", _state())
    out, bytes_read, info = _read_rows(tmp_path / "c", 100, 37)
    assert torch.equal(out, _weight()[100:137])
    assert bytes_read == _verified_bytes(tmp_path / "c", info, 100, 37)
    item_length = next(v.length for k, v in info.metadata.storage_data.items() if k.fqn == "w")
    assert bytes_read < item_length / 5


def test_damage_to_the_header_that_locates_the_rows_is_refused(tmp_path, small_blocks):
    """A flipped bit in the data record's local header (its extra-field length) would shift
    the rows read by 64 bytes into intact blocks; the header's own block is verified too."""
    ckptlib.save(tmp_path / "c", _state())
    _, _, info = _read_rows(tmp_path / "c", 0, 1)
    (entry,) = [v for k, v in info.metadata.storage_data.items() if k.fqn == "w"]
    path = tmp_path / "c" / "__0_0.distcp"
    item = path.read_bytes()[entry.offset : entry.offset + entry.length]
    record = zip_directory.tensor_data_record(lambda pos, n: item[pos : pos + n], len(item))
    local_at = record.parsed[0][0]
    extra_len_at = entry.offset + local_at + 28
    _flip(path, extra_len_at)  # 62 -> 126: still 64-byte aligned, still inside the item
    with pytest.raises(CheckpointCorruptError, match=rf"file block {extra_len_at // BLOCK} "):
        _read_rows(tmp_path / "c", 700, 37)


def test_whole_item_reads_still_use_the_item_crc(tmp_path, small_blocks):
    ckptlib.save(tmp_path / "c", _state())
    out, bytes_read, info = _read_rows(tmp_path / "c", 0, ROWS)
    assert torch.equal(out, _weight())
    item_length = next(v.length for k, v in info.metadata.storage_data.items() if k.fqn == "w")
    assert bytes_read == item_length


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_damage_in_a_covering_block_is_refused_naming_it(tmp_path, small_blocks):
    ckptlib.save(tmp_path / "c", _state())
    _, _, info = _read_rows(tmp_path / "c", 0, 1)
    at = _data_start(tmp_path / "c", info) + 110 * COLS * 4 + 3  # inside row 110
    _flip(tmp_path / "c" / "__0_0.distcp", at)
    block = at // BLOCK
    with pytest.raises(CheckpointCorruptError) as err:
        _read_rows(tmp_path / "c", 100, 37)
    assert str(err.value).endswith(
        f": file block {block} (bytes {block * BLOCK}..{(block + 1) * BLOCK}) does not match its checksum"
    )
    assert "__0_0.distcp: checksum mismatch in tensor 'w' at offset" in str(err.value)


def test_damage_outside_the_read_blocks_is_left_to_ckpt_verify(tmp_path, small_blocks, capsys):
    ckptlib.save(tmp_path / "c", _state())
    _, _, info = _read_rows(tmp_path / "c", 0, 1)
    start = _data_start(tmp_path / "c", info)
    at = start + 900 * COLS * 4
    _flip(tmp_path / "c" / "__0_0.distcp", at)
    out, _, _ = _read_rows(tmp_path / "c", 100, 37)  # rows 100..136 never share a block with row 900
    assert torch.equal(out, _weight()[100:137])
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert re.search(
        r"__0_0\.distcp \(rank 0's shard\): checksum mismatch in (tensor|object) '", capsys.readouterr().out
    )


def test_ckpt_verify_checks_block_crcs(tmp_path, small_blocks, capsys):
    """A manifest whose block CRC is wrong while the file is intact: only the block check sees it."""
    ckptlib.save(tmp_path / "c", _state())
    path = tmp_path / "c" / "ckptlib.json"
    doc = json.loads(path.read_text())
    doc["files"]["__0_0.distcp"]["blocks"]["crc32"][3] ^= 1
    doc.pop("checksum")
    path.write_text(json.dumps(doc))
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert f"__0_0.distcp (rank 0's shard): checksum mismatch in file block 3 (bytes {3 * BLOCK}..{4 * BLOCK})\n" in out
    assert out.count("checksum mismatch") == 1


def test_manifest_without_blocks_still_loads(tmp_path, small_blocks):
    """Checkpoints written before block checksums: the item CRC covers resharded reads."""
    ckptlib.save(tmp_path / "c", _state())
    path = tmp_path / "c" / "ckptlib.json"
    doc = json.loads(path.read_text())
    for record in doc["files"].values():
        record.pop("blocks", None)
    doc.pop("checksum")
    path.write_text(json.dumps(doc))
    out, bytes_read, info = _read_rows(tmp_path / "c", 100, 37)
    assert torch.equal(out, _weight()[100:137])
    item_length = next(v.length for k, v in info.metadata.storage_data.items() if k.fqn == "w")
    assert bytes_read == item_length


@pytest.mark.parametrize(
    "blocks, problem",
    [
        ({"size": 4096, "crc32": [1]}, "1 block checksums for 10000 bytes in blocks of 4096 (needs 3)"),
        ({"size": 0, "crc32": [1]}, "block size 0 with 1 block checksums"),
        ({"size": 4096, "crc32": [1, 2, 1 << 32]}, "a block crc32 out of range"),
    ],
    ids=["too-few", "no-size", "out-of-range"],
)
def test_malformed_block_lists_are_refused(blocks, problem):
    with pytest.raises(CheckpointCorruptError, match=rf"^m: malformed file record \({re.escape(problem)}\)$"):
        FileRecord.from_json({"size": 10000, "crc32": 0, "items": [], "blocks": blocks}, "m")


def test_encoder_cuts_at_block_boundaries_without_changing_bytes(tmp_path, small_blocks, monkeypatch):
    ckptlib.save(tmp_path / "fast", _state())
    monkeypatch.setattr(item_encoder, "encode", lambda *args: None)
    ckptlib.save(tmp_path / "plain", _state())
    name = "__0_0.distcp"  # (.metadata names its own directory, so it differs)
    assert (tmp_path / "fast" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    assert _manifest(tmp_path / "fast")["files"][name] == _manifest(tmp_path / "plain")["files"][name]


@pytest.fixture
def without_zlib_ng(monkeypatch):
    """What an install without the `fast` extra runs: the standard zlib, no crc32_combine."""
    verify_module = importlib.import_module("ckptlib.format.verify")  # (the package exports a function `verify`)

    for module in (block_checks, dcp_reader, verify_module, item_encoder):
        monkeypatch.setattr(module, "crc32", zlib.crc32)
        if hasattr(module, "crc32_combine"):
            monkeypatch.setattr(module, "crc32_combine", None)
    monkeypatch.setattr(item_encoder, "FAST", False)
    item_encoder.fast_path_reason.cache_clear()
    yield
    monkeypatch.undo()
    item_encoder.fast_path_reason.cache_clear()


def test_without_zlib_ng_checksums_are_the_same_minus_blocks(tmp_path, without_zlib_ng, capsys):
    assert item_encoder.encode(torch.ones(3)) is None  # torch.save writes the items
    ckptlib.save(tmp_path / "c", _state())
    record = _manifest(tmp_path / "c")["files"]["__0_0.distcp"]
    assert "blocks" not in record
    data = (tmp_path / "c" / "__0_0.distcp").read_bytes()
    assert record["crc32"] == zlib.crc32(data)
    assert [zlib.crc32(data[o : o + n]) for o, n, _ in record["items"]] == [c for _, _, c in record["items"]]
    out, bytes_read, info = _read_rows(tmp_path / "c", 100, 37)
    assert torch.equal(out, _weight()[100:137])
    assert bytes_read == next(v.length for k, v in info.metadata.storage_data.items() if k.fqn == "w")
    assert cli.main(["verify", str(tmp_path / "c")]) == 0
    _flip(tmp_path / "c" / "__0_0.distcp", len(data) // 2)
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert re.search(r"checksum mismatch in (tensor|object) '", capsys.readouterr().out)
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch in tensor '[^']+' at offset"):
        ckptlib.load(
            tmp_path / "c", {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(777, dtype=torch.bfloat16), "n": 0}
        )


_WITHOUT_ZLIB_NG = """
import sys, zlib
sys.modules["zlib_ng"] = sys.modules["zlib_ng.zlib_ng"] = None  # as if installed with --no-deps
import torch, ckptlib
from ckptlib import cli
from ckptlib.format.items import checksum
from ckptlib.format.native.layout import read_manifest
from ckptlib.storage import open_storage
assert checksum.crc32_combine is None and checksum.crc32 is zlib.crc32
path = sys.argv[1]
state = {f"t{i}": torch.arange(i * 10 + 1, dtype=dtype) for i, dtype in
         enumerate([torch.float32, torch.bfloat16, torch.int64, torch.float32, torch.bfloat16])}
state["m"] = torch.arange(6.0).reshape(2, 3)
ckptlib.save(path, state)
into = {k: torch.zeros_like(v) for k, v in state.items()}
ckptlib.load(path, into)
assert all(torch.equal(into[k], v) for k, v in state.items())
record = read_manifest(open_storage(path)).files["__0_0.distcp"]
with open(path + "/__0_0.distcp", "rb") as f:
    assert record.crc32 == zlib.crc32(f.read())
sys.exit(cli.main(["verify", path]))
"""


def test_an_install_without_zlib_ng_saves_small_items_loads_and_verifies(tmp_path):
    """Small items go through the writer's per-signature templates, whose CRCs need no
    crc32_combine: without zlib-ng the standard zlib's running CRC gives the same values."""
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ZLIB_NG, str(tmp_path / "c")], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == f"{tmp_path / 'c'}: OK"


# --------------------------------------------------------------------------- S3 (moto)


def _s3_flip(uri: str, name: str, offset: int) -> None:
    storage = open_storage(uri)
    data = bytearray(storage.read(name))
    data[offset] ^= 0x40
    storage.write(name, bytes(data))


@pytest.mark.s3
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_s3_resharded_read_fetches_only_the_rows_and_their_blocks(s3_root, small_blocks, tmp_path, verify):
    uri = s3_root + "/c"
    ckptlib.save(uri, _state())
    out, bytes_read, info = _read_rows(uri, 100, 37, verify=verify)
    assert torch.equal(out, _weight()[100:137])
    ckptlib.save(tmp_path / "local", _state())  # the same bytes locally, to locate the rows
    _, _, local_info = _read_rows(tmp_path / "local", 0, 1)
    assert bytes_read == (_verified_bytes(tmp_path / "local", local_info, 100, 37) if verify else 37 * COLS * 4)


@pytest.mark.s3
def test_s3_damage_in_a_covering_block_is_refused(s3_root, small_blocks, tmp_path):
    uri = s3_root + "/c"
    ckptlib.save(uri, _state())
    ckptlib.save(tmp_path / "local", _state())
    _, _, local_info = _read_rows(tmp_path / "local", 0, 1)
    at = _data_start(tmp_path / "local", local_info) + 110 * COLS * 4 + 3
    _s3_flip(uri, "__0_0.distcp", at)
    block = at // BLOCK
    with pytest.raises(CheckpointCorruptError) as err:
        _read_rows(uri, 100, 37)
    assert str(err.value).endswith(
        f": file block {block} (bytes {block * BLOCK}..{(block + 1) * BLOCK}) does not match its checksum"
    )
    out, _, _ = _read_rows(uri, 300, 10)  # rows far from the damage: their blocks are intact
    assert torch.equal(out, _weight()[300:310])


def _planned_bytes_per_rank(uri: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    seen = []
    real = dcp_writer.block_size_for
    dcp_writer.block_size_for = lambda planned: seen.append(planned) or real(planned)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ckptlib.save(uri, {"w": distribute_tensor(torch.ones(1000, 500), mesh, [Shard(0)])})
    return seen[0]


def test_block_size_follows_each_ranks_own_bytes(tmp_path, dist_run):
    """Sized from the rank's chunk (250 rows of 500 float32), not the global tensor."""
    assert dist_run(4, _planned_bytes_per_rank, str(tmp_path / "c")) == [250 * 500 * 4] * 4


class _IntoTensors:
    def __init__(self, targets: dict):
        self.targets = targets

    def resolve_tensor(self, item):
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item, tensor):
        pass


def test_blocks_verified_once_per_load(tmp_path, small_blocks):
    """Two adjacent items read in one load: the block holding the first's zip directory and
    the second's header is read and verified once, not twice."""
    w2 = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(9))
    ckptlib.save(tmp_path / "c", {"w": _weight(), "w2": w2})
    reader, info = open_reader(open_storage(str(tmp_path / "c")), verify=True)
    want = ChunkStorageMetadata(offsets=torch.Size([100, 0]), sizes=torch.Size([37, COLS]))
    items = []
    for fqn in ("w", "w2"):
        items += create_read_items_for_chunk_list(fqn, info.metadata.state_dict_metadata[fqn], [want])
    out = {"w": torch.zeros(37, COLS), "w2": torch.zeros(37, COLS)}
    reader.read_data(LoadPlan(items), _IntoTensors(out)).wait()
    assert torch.equal(out["w"], _weight()[100:137]) and torch.equal(out["w2"], w2[100:137])
    covered: set[int] = set()
    shared = None
    for fqn in ("w", "w2"):
        (entry,) = [v for k, v in info.metadata.storage_data.items() if k.fqn == fqn]
        item = (tmp_path / "c" / entry.relative_path).read_bytes()[entry.offset : entry.offset + entry.length]
        record = zip_directory.tensor_data_record(lambda pos, n: item[pos : pos + n], len(item))
        rows = (record.start + 100 * COLS * 4, record.start + 137 * COLS * 4)
        blocks = [
            set(range((entry.offset + lo) // BLOCK, -(-(entry.offset + hi) // BLOCK)))
            for lo, hi in [rows, *record.parsed]
        ]
        shared = blocks[2] if fqn == "w" else shared & blocks[1]  # w's directory, w2's header
        covered |= set().union(*blocks)
    assert shared  # the case this test is about: the two items share a block
    size = (tmp_path / "c" / "__0_0.distcp").stat().st_size  # w2's directory sits in the short last block
    assert reader.bytes_read == sum(min((i + 1) * BLOCK, size) - i * BLOCK for i in covered)
