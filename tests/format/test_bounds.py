"""Crafted but well-formed content never allocates without bound, and a `.metadata` that
disagrees with the stored items is caught by verify and by load.

Before: a manifest world_size of 10^12 made verify build set(range(world_size)); a
`.metadata` tensor shape of (10^7, 10^6) made convert allocate 40 TB; a 40-byte `.metadata`
pickle built a 2 GB bytearray; a shape in `.metadata` that disagreed with the stored bytes
(CRCs consistent) passed `ckpt verify` and the load died with a raw RuntimeError.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlib
from ckptlib import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError, cli
from ckptlib.format import verify
from ckptlib.format.native.manifest import _canonical
from ckptlib.format.native.safe_pickle import safe_loads


def _rewrite_manifest(d, edit) -> None:
    doc = json.loads((d / "ckptlib.json").read_text())
    doc.pop("checksum", None)
    edit(doc)
    doc["checksum"] = zlib.crc32(_canonical(doc))
    (d / "ckptlib.json").write_text(json.dumps(doc))


def _rewrite_metadata(d, edit, *, manifest: bool = True) -> None:
    """Edit `.metadata` (our own file, so plain pickle is fine here) and, for a ckptlib
    checkpoint, record its new size and CRC in the manifest: every checksum stays consistent."""
    md = pickle.loads((d / ".metadata").read_bytes())
    edit(md)
    blob = pickle.dumps(md)
    (d / ".metadata").write_bytes(blob)
    if manifest:
        crc = zlib.crc32(blob)

        def fix(doc):
            doc["files"][".metadata"] = {"size": len(blob), "crc32": crc, "items": [[0, len(blob), crc]]}

        _rewrite_manifest(d, fix)


def _declare(md, key: str, size: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    """Make `.metadata` declare `key` (one chunk) with another size and/or dtype."""
    tmd = md.state_dict_metadata[key]
    tmd.size = torch.Size(size)
    if dtype is not None:
        tmd.properties.dtype = dtype
    (chunk,) = tmd.chunks
    chunk.sizes = torch.Size(size)


def _save(d, kind: str, state: dict) -> None:
    if kind == "ckptlib":
        ckptlib.save(d, state)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(d))


def _errors(path) -> list:
    return [p for p in verify(path) if p.is_error]


# --------------------------------------------------------------------------- manifest counts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [10**12, 3, 2.0, True], ids=["1e12", "3-with-one-shard", "float", "bool"])
def test_manifest_world_size_lie(tmp_path, capsys, world_size):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4)})
    _rewrite_manifest(d, lambda doc: doc.__setitem__("world_size", world_size))
    errors = _errors(d)
    assert errors and errors[0].file == "ckptlib.json", errors
    with pytest.raises(CheckpointCorruptError, match="ckptlib.json"):
        ckptlib.load(d, {"w": torch.zeros(4)})
    assert cli.main(["verify", str(d)]) == 1
    assert cli.main(["inspect", str(d)]) == 1
    capsys.readouterr()


@pytest.mark.timeout(60)
def test_manifest_missing_ranks_are_listed_without_building_the_range(tmp_path):
    from ckptlib.format.native.manifest import FileRecord, Manifest
    from ckptlib.format.verify import _manifest_problems

    files = {f"__{r}_0.distcp": FileRecord(size=0, crc32=0) for r in (0, 2)}
    files.update({f"x{i}": FileRecord(size=0, crc32=0) for i in range(10)})
    problems = _manifest_problems(Manifest(world_size=12, files=files))
    assert [p.message for p in problems] == [
        "lists no shard file for rank(s) 1, 3, 4, 5, 6, 7, 8, 9, 10, 11 of the 12 that saved"
    ]
    problems = _manifest_problems(Manifest(world_size=10**12, files=files))  # constructed directly, not parsed
    assert ", 20, 21 and 999999999978 more of the 1000000000000 that saved" in problems[0].message


# --------------------------------------------------------------------------- .metadata sizes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ckptlib", "dcp"])
def test_metadata_shape_of_40_terabytes_is_refused_before_allocating(tmp_path, capsys, kind):
    d = tmp_path / "c"
    _save(d, kind, {"w": torch.ones(4, 4)})
    _rewrite_metadata(d, lambda md: _declare(md, "w", (10**7, 10**6)), manifest=kind == "ckptlib")
    errors = _errors(d)
    assert any("needs 40000000000000 bytes" in p.message for p in errors), errors
    with pytest.raises(CheckpointCorruptError, match="needs 40000000000000 bytes"):
        ckptlib.load(d, {"w": torch.zeros(4, 4)})
    with pytest.raises(CheckpointCorruptError, match="needs 40000000000000 bytes"):
        ckptlib.convert(d, tmp_path / "out", progress=False)
    with pytest.raises(CheckpointCorruptError):
        ckptlib.convert(d, tmp_path / "out.pt", to="torch", progress=False)
    assert cli.main(["inspect", str(d)]) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.pt").exists()
    capsys.readouterr()


class _Allocates:
    """Pickles as a call of `fn(*args)` (what a crafted file would hold)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "payload",
    [_Allocates(bytearray, 2**31), _Allocates(bytes, 2**31)],
    ids=["bytearray-2GB", "bytes-2GB"],
)
def test_metadata_pickle_cannot_allocate_from_a_number(tmp_path, capsys, payload):
    blob = pickle.dumps(payload, protocol=2)
    assert len(blob) < 60
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle global"):
        safe_loads(blob, "x/.metadata")
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(2)})
    (d / ".metadata").write_bytes(blob)
    crc = zlib.crc32(blob)
    _rewrite_manifest(
        d,
        lambda doc: doc["files"].__setitem__(
            ".metadata", {"size": len(blob), "crc32": crc, "items": [[0, len(blob), crc]]}
        ),
    )
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing to unpickle global __builtin__\.byte"):
        ckptlib.load(d, {"w": torch.zeros(2)})
    assert any(p.kind == "unsafe" for p in verify(d))
    assert cli.main(["inspect", str(d)]) == 1
    capsys.readouterr()


def test_allocation_scan_refuses_only_counts_given_to_bytes_and_bytearray():
    """The scan refuses `builtins.bytearray(n)` / `bytes(n)`; other builtins called with a
    number (a saved `range(5)`, a `slice`) and a global merely named `bytes` elsewhere pass."""
    from ckptlib.format.native.safe_pickle import check_no_allocating_calls

    check_no_allocating_calls(pickle.dumps({"r": range(5), "s": slice(2, 9)}, protocol=2), "x")
    elsewhere = b"\x80\x02cmymodule\nbytes\n\x8a\x05\x00\x00\x00\x80\x00\x85R."  # mymodule.bytes(2**31)
    check_no_allocating_calls(elsewhere, "x")
    with pytest.raises(UnsafeCheckpointError, match=r"^x: the pickle builds bytes\(2147483648\) from a number"):
        check_no_allocating_calls(pickle.dumps(_Allocates(bytes, 2**31), protocol=2), "x")
    with pytest.raises(UnsafeCheckpointError, match=r"^x: the pickle builds bytearray\(2147483648\) from a number"):
        check_no_allocating_calls(pickle.dumps(_Allocates(bytearray, 2**31, "ascii"), protocol=2), "x")


@pytest.mark.parametrize(
    "step,ok", [(2**63 - 1, True), (2**63, False), (-1, False)], ids=["int64-max", "past-int64", "negative"]
)
def test_manifest_step_must_be_a_non_negative_int64(tmp_path, step, ok):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4)})
    _rewrite_manifest(d, lambda doc: doc.__setitem__("step", step))
    if ok:
        assert _errors(d) == []
        ckptlib.load(d, {"w": torch.zeros(4)})
    else:
        assert [p.file for p in _errors(d)] == ["ckptlib.json"]
        with pytest.raises(CheckpointCorruptError, match="ckptlib.json"):
            ckptlib.load(d, {"w": torch.zeros(4)})


@pytest.mark.parametrize("crc", [-1, 1 << 32], ids=["negative", "past-32-bits"])
def test_a_manifest_item_crc_outside_32_bits_is_a_bad_record(tmp_path, crc):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4)})
    _rewrite_manifest(d, lambda doc: doc["files"]["__0_0.distcp"]["items"][0].__setitem__(2, crc))
    errors = _errors(d)
    assert errors and errors[0].file == "ckptlib.json" and "a bad crc32" in errors[0].message, errors


@pytest.mark.parametrize("version", [0, 2, "1"], ids=["zero", "newer", "text"])
def test_a_manifest_format_version_this_ckptlib_cannot_read_is_refused(tmp_path, version):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4)})
    _rewrite_manifest(d, lambda doc: doc.__setitem__("format_version", version))
    with pytest.raises(
        CheckpointCorruptError,
        match=rf"manifest format_version {version!r} is not supported \(this ckptlib reads 1\.\.1; upgrade ckptlib\)",
    ):
        ckptlib.load(d, {"w": torch.zeros(4)})


def test_an_item_the_manifest_does_not_record_is_refused(tmp_path):
    """A shard item `.metadata` points at but the manifest's item list lacks: the load refuses
    it as corrupt before reading, naming the file, key and offset, instead of reading bytes
    nothing vouches for."""
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4)})
    _rewrite_manifest(d, lambda doc: doc["files"]["__0_0.distcp"].__setitem__("items", []))
    with pytest.raises(
        CheckpointCorruptError,
        match=r"__0_0\.distcp \(rank 0's shard\): the storage record of 'w' at "
        r"offset 0 \(length \d+\) matches no item record of the manifest",
    ):
        ckptlib.load(d, {"w": torch.zeros(4)})


@pytest.mark.parametrize("count", [8, 9], ids=["8-files", "9-files"])
def test_a_refused_deletion_names_eight_foreign_files_then_counts(count):
    from ckptlib.format.native.deletion import describe_foreign

    names = [f"notes{i}.txt" for i in range(count)]
    text = describe_foreign("file:///r/step_1", names)
    assert ", ".join(names[:8]) in text
    assert (f"... ({count} in all)" in text) == (count > 8) and "notes8.txt" not in text


# --------------------------------------------------------------------------- shapes vs stored items

SIZES = {"small": (3, 4), "large": (512, 1024)}  # large: the zero-copy read path (>= 1 MiB)
LIES = {
    "transposed": lambda s: ((s[1], s[0]), None),
    "fewer-rows": lambda s: ((s[0] - 1, s[1]), None),
    "dtype": lambda s: (s, torch.int32),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lie", list(LIES))
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("kind", ["ckptlib", "dcp"])
def test_metadata_shape_that_disagrees_with_the_stored_item(tmp_path, capsys, kind, size, lie):
    shape = SIZES[size]
    d = tmp_path / "c"
    _save(d, kind, {"w": torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape), "b": torch.ones(3)})
    declared, dtype = LIES[lie](shape)
    _rewrite_metadata(d, lambda md: _declare(md, "w", declared, dtype), manifest=kind == "ckptlib")
    errors = _errors(d)
    assert any(p.file == "__0_0.distcp" and "'w'" in p.message and "declares" in p.message for p in errors), errors
    assert cli.main(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "__0_0.distcp" in out and "declares shape" in out
    with pytest.raises(CheckpointError) as info:
        ckptlib.load(d, {"w": torch.zeros(declared, dtype=dtype or torch.float32), "b": torch.zeros(3)})
    assert isinstance(info.value, CheckpointCorruptError), repr(info.value)
    assert "__0_0.distcp" in str(info.value) and "w" in str(info.value)


def test_a_chunk_that_is_not_a_chunk_is_a_finding(tmp_path):
    """A crafted `.metadata` whose chunk list holds something without offsets and sizes: verify
    reports the malformed chunk and load refuses the checkpoint as corrupt, neither raises
    AttributeError."""
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4), "b": torch.ones(3)})
    _rewrite_metadata(d, lambda md: setattr(md.state_dict_metadata["w"], "chunks", [5]))
    errors = _errors(d)
    assert [(p.file, p.message) for p in errors] == [(".metadata", "tensor 'w' has a malformed chunk 5")], errors
    with pytest.raises(CheckpointCorruptError, match="tensor 'w' has a malformed chunk 5"):
        ckptlib.load(d, {"w": torch.zeros(4), "b": torch.zeros(3)})


@pytest.mark.parametrize("size", [["x"], [None], 4], ids=["text", "none", "not-a-list"])
def test_a_tensor_size_that_is_not_numbers_is_a_finding(tmp_path, size):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4)})
    _rewrite_metadata(d, lambda md: setattr(md.state_dict_metadata["w"], "size", size))
    errors = _errors(d)
    assert [(p.file, p.message) for p in errors] == [(".metadata", f"tensor 'w' has an invalid size {size!r}")], errors


def test_a_chunk_starting_before_its_tensor_is_a_finding(tmp_path):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(4), "b": torch.ones(3)})

    def shift(md):
        (chunk,) = md.state_dict_metadata["w"].chunks
        chunk.offsets = torch.Size([-1])

    _rewrite_metadata(d, shift)
    errors = _errors(d)
    assert [(p.file, p.message) for p in errors][:1] == [
        (".metadata", "tensor 'w' of shape [4]: chunk at offsets [-1] with sizes [4] lies outside the tensor")
    ], errors
    with pytest.raises(CheckpointCorruptError, match="'w'"):
        ckptlib.load(d, {"w": torch.zeros(4), "b": torch.zeros(3)})


def test_a_damaged_file_does_not_stop_the_other_files_items_being_checked(tmp_path):
    """verify decodes no item of a file it already found damaged (one finding per damage), and
    still checks every item of the other files against `.metadata`: a two-rank checkpoint with
    rank 0's file damaged and a dtype `.metadata` misdeclares reports both, each once."""
    d = tmp_path / "c"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "fixtures", "ckptlib", "ckpt"), d)
    damaged = bytearray((d / "__0_0.distcp").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (d / "__0_0.distcp").write_bytes(bytes(damaged))

    def misdeclare(md):
        md.state_dict_metadata["model.embed.weight"].properties.dtype = torch.int32

    _rewrite_metadata(d, misdeclare)
    errors = _errors(d)
    assert [p.file for p in errors] == ["__0_0.distcp", "__1_0.distcp"], errors
    assert re.match(r"checksum mismatch in (tensor|object) '[^']+'.* at offset", errors[0].message), errors[0]
    assert "'model.embed.weight'" in errors[1].message and "dtype int32" in errors[1].message, errors[1]


def test_verify_passes_intact_checkpoints_with_many_items(tmp_path):
    d = tmp_path / "c"
    state = {f"t{i}": torch.full((i + 1, 3), float(i)) for i in range(30)}
    state["big"] = torch.ones(600, 1024)
    state["obj"] = {"lr": 0.1}
    ckptlib.save(d, state)
    assert _errors(d) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn", [bytearray, bytes], ids=["bytearray", "bytes"])
def test_object_item_cannot_allocate_from_a_number(tmp_path, fn):
    """torch's weights_only unpickler allows bytearray: an object item holding `bytearray(2**40)`
    (a few hundred bytes of file) is refused before torch.load runs it."""
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(2), "extra": {"blob": _Allocates(fn, 2**40), "n": 3}})
    assert _errors(d) == []  # the bytes are the ones written; only loading them would allocate
    with pytest.raises(UnsafeCheckpointError, match=r"\(1099511627776\) from a number") as info:
        ckptlib.load(d, {"w": torch.zeros(2), "extra": {"blob": None, "n": 0}})
    assert "__0_0.distcp" in str(info.value) and "extra" in str(info.value)


def test_object_items_with_real_byte_values_still_load(tmp_path):
    d = tmp_path / "c"
    ckptlib.save(d, {"w": torch.ones(2), "raw": bytearray(b"\x00\x01abc"), "b": b"xyz"})
    state = {"w": torch.zeros(2), "raw": bytearray(), "b": b""}
    ckptlib.load(d, state)
    assert state["raw"] == bytearray(b"\x00\x01abc") and state["b"] == b"xyz"


def test_verify_reads_item_headers_without_running_their_pickles(tmp_path, capsys):
    """verify's check of each item's own header is a weights_only torch.load: a crafted item
    whose pickle calls a function is a finding, and the function never runs."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ckptlib._torch.dcp_shims import storage_info_cls
    from ckptlib.format.verify import _declared_item_problems
    from ckptlib.storage import open_storage

    buf = io.BytesIO()
    torch.save(_Allocates(print, "EXECUTED BY VERIFY"), buf)  # what a crafted item would run if unpickled freely
    (tmp_path / "evil.distcp").write_bytes(buf.getvalue())
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    md = Metadata(
        {
            "w": TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.float32), size=torch.Size([4]), chunks=[chunk]
            )
        },
        storage_data={MetadataIndex("w", torch.Size([0])): storage_info_cls()("evil.distcp", 0, len(buf.getvalue()))},
    )
    problems = _declared_item_problems(open_storage(str(tmp_path)), md, set())
    assert [p.file for p in problems] == ["evil.distcp"]
    assert "cannot be decoded as a tensor (UnpicklingError" in problems[0].message
    assert "EXECUTED BY VERIFY" not in capsys.readouterr().out
