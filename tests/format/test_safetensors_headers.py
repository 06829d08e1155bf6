"""Crafted safetensors headers: each is refused as CheckpointCorruptError naming the file and the
key (as strictly as the safetensors library's own validation), by the reader, ckptlib.load and
every `ckpt` command that opens it (exit code 1, one line, no traceback)."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch

import ckptlib
from ckptlib import cli
from ckptlib.errors import CheckpointCorruptError, UnsafeCheckpointError, UnsupportedError
from ckptlib.format.source import open_reader

pytestmark = pytest.mark.legacy

F32x6 = {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}
DATA24 = torch.arange(6.0).numpy().tobytes()


def write_st(path, header, data: bytes = DATA24, *, raw_header: bytes | None = None) -> str:
    """A safetensors file with exactly this header (a dict, or raw JSON bytes) and data section."""
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def entry(**changes):
    return {**F32x6, **changes}


# name -> (header, data section, raw header bytes or None, message regex after "model.safetensors: ")
CRAFTED = {
    "offsets-strings": (
        {"w": entry(data_offsets=["0", "24"])},
        DATA24,
        None,
        r"tensor 'w': data_offsets \['0', '24'\] is not two non-negative integers",
    ),
    "offsets-floats": (
        {"w": entry(data_offsets=[0.0, 24.0])},
        DATA24,
        None,
        r"tensor 'w': data_offsets \[0.0, 24.0\] is not two non-negative integers",
    ),
    "offsets-three": ({"w": entry(data_offsets=[0, 12, 24])}, DATA24, None, r"tensor 'w': data_offsets \[0, 12, 24\]"),
    "offsets-negative": ({"w": entry(data_offsets=[-4, 20])}, DATA24, None, r"tensor 'w': data_offsets \[-4, 20\]"),
    "offsets-reversed": (
        {"w": entry(shape=[0], data_offsets=[24, 0])},
        DATA24,
        None,
        r"tensor 'w': data_offsets \[24, 0\] end before they begin",
    ),
    "offsets-missing": ({"w": {"dtype": "F32", "shape": [6]}}, DATA24, None, r"tensor 'w': entry lacks data_offsets"),
    "dtype-list": ({"w": entry(dtype=["F32"])}, DATA24, None, r"tensor 'w': dtype \['F32'\] is not a string"),
    "dtype-unknown": ({"w": entry(dtype="F33")}, DATA24, None, r"tensor 'w': unknown dtype 'F33'"),
    "shape-negative": (
        {"w": entry(shape=[-6])},
        DATA24,
        None,
        r"tensor 'w': shape \[-6\] is not a list of non-negative",
    ),
    "shape-float": ({"w": entry(shape=[6.0])}, DATA24, None, r"tensor 'w': shape \[6.0\] is not a list"),
    "shape-fractional": ({"w": entry(shape=[1.5, 4])}, DATA24, None, r"tensor 'w': shape \[1.5, 4\] is not a list"),
    "shape-bool": ({"w": entry(shape=[True, 6])}, DATA24, None, r"tensor 'w': shape \[True, 6\] is not a list"),
    "shape-not-list": ({"w": entry(shape=6)}, DATA24, None, r"tensor 'w': shape 6 is not a list"),
    "size-mismatch": (
        {"w": entry(shape=[5])},
        DATA24,
        None,
        r"tensor 'w': data_offsets \[0, 24\] hold 24 bytes, but F32 \[5\] needs 20",
    ),
    "entry-not-object": ({"w": 5}, DATA24, None, r"tensor 'w': entry is a int, not an object"),
    "overlap": (
        {"a": F32x6, "b": entry(shape=[3], data_offsets=[12, 24])},
        DATA24,
        None,
        r"tensor 'b': it overlaps 'a'",
    ),
    "gap": (
        {"a": F32x6, "b": entry(shape=[3], data_offsets=[28, 40])},
        DATA24 + bytes(16),
        None,
        r"tensor 'b': a gap of 4 bytes before it",
    ),
    "not-from-zero": ({"w": entry(data_offsets=[4, 28])}, bytes(4) + DATA24, None, r"tensor 'w': a gap of 4 bytes"),
    "trailing-bytes": (
        {"w": F32x6},
        DATA24 + bytes(8),
        None,
        r"8 bytes of the data section after tensor 'w' belong to no tensor",
    ),
    "truncated": (
        {"w": F32x6},
        DATA24[:20],
        None,
        r"tensor 'w': data_offsets end at 24, past the 20-byte data section",
    ),
    "duplicate-key": (
        None,
        DATA24,
        b'{"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}, '
        b'"w": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}',
        r"safetensors header has the key 'w' twice",
    ),
    "metadata-not-strings": (
        {"__metadata__": {"format": 1}, "w": F32x6},
        DATA24,
        None,
        r"__metadata__ must map strings to strings",
    ),
    "metadata-not-object": ({"__metadata__": ["pt"], "w": F32x6}, DATA24, None, r"__metadata__ must map strings"),
    "header-list": (None, DATA24, b"[1, 2]", r"safetensors header is not a JSON object"),
    "header-not-json": (None, DATA24, b"{not json", r"unreadable safetensors header"),
    "header-not-utf8": (None, DATA24, b'{"\xff": 1}', r"unreadable safetensors header"),
}


@pytest.mark.parametrize("case", list(CRAFTED), ids=list(CRAFTED))
def test_crafted_header_is_refused_naming_file_and_key(tmp_path, case):
    header, data, raw, message = CRAFTED[case]
    path = write_st(tmp_path / "model.safetensors", header, data, raw_header=raw)
    with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors: " + message) as err:
        open_reader(path)
    assert err.value.path == path
    with pytest.raises(CheckpointCorruptError, match=message):
        ckptlib.load(path, {"model": {"w": torch.zeros(6)}})


@pytest.mark.parametrize("case", ["offsets-strings", "dtype-list", "shape-negative", "shape-fractional", "overlap"])
def test_cli_convert_reports_crafted_header_without_traceback(tmp_path, capsys, case):
    header, data, raw, message = CRAFTED[case]
    (tmp_path / "st").mkdir()
    path = write_st(tmp_path / "st" / "model.safetensors", header, data, raw_header=raw)
    rc = cli.main(["convert", str(tmp_path / "st"), str(tmp_path / "out"), "--to", "dcp", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_FAIL, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"ckpt convert: error: {path}: "), err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_inspect_and_verify_report_a_crafted_safetensors_header(tmp_path, capsys, command):
    """inspect and verify read safetensors directories (issue 28) and check every header as a
    load does: a crafted one is damage named by file and key (exit 1), never a traceback."""
    (tmp_path / "st").mkdir()
    write_st(tmp_path / "st" / "model.safetensors", {"w": entry(shape=[-6])})
    rc = cli.main([command, str(tmp_path / "st")])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_FAIL, (out, err)
    why = "tensor 'w': shape [-6] is not a list of non-negative integers"
    where = tmp_path / "st" / "model.safetensors"
    if command == "inspect":
        assert err.strip() == f"ckpt inspect: error: {where}: {why}"
    else:
        assert out.splitlines() == [f"{where}: {why}", f"{tmp_path / 'st'}: DAMAGED, 1 problem"]


def test_header_length_over_the_library_limit(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}" + DATA24)
    with pytest.raises(CheckpointCorruptError, match=r"header length 100000001 exceeds the 100000000-byte limit"):
        open_reader(str(path))


def test_zero_sized_tensors_and_metadata_are_valid(tmp_path):
    header = {
        "__metadata__": {"format": "pt"},
        "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "w": F32x6,
        "also_empty": {"dtype": "I64", "shape": [2, 0], "data_offsets": [24, 24]},
    }
    path = write_st(tmp_path / "model.safetensors", header)
    state = {
        "model": {"w": torch.zeros(6), "empty": torch.ones(0, 3), "also_empty": torch.ones(2, 0, dtype=torch.int64)}
    }
    ckptlib.load(path, state)
    assert torch.equal(state["model"]["w"], torch.arange(6.0))
    assert state["model"]["empty"].shape == (0, 3)


def test_unsupported_but_known_dtype_is_unsupported_error(tmp_path):
    path = write_st(tmp_path / "model.safetensors", {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(UnsupportedError, match=r"model\.safetensors: tensor 'w' has dtype F4"):
        open_reader(path)


def write_index(directory, weight_map=None, *, raw: bytes | None = None) -> str:
    body = raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    (directory / "model.safetensors.index.json").write_bytes(body)
    return str(directory)


INDEXES = {
    "weight-map-missing": (None, b'{"metadata": {}}', CheckpointCorruptError, r"no weight_map object"),
    "weight-map-list": (None, b'{"weight_map": ["w"]}', CheckpointCorruptError, r"no weight_map object"),
    "file-not-string": ({"w": 3}, None, CheckpointCorruptError, r"weight_map\['w'\] is 3, not a file name"),
    "file-empty": ({"w": ""}, None, CheckpointCorruptError, r"weight_map\['w'\] is '', not a file name"),
    "file-escapes": ({"w": "../model.safetensors"}, None, UnsafeCheckpointError, r"\.\./model\.safetensors"),
    "file-absent": ({"w": "nope.safetensors"}, None, CheckpointCorruptError, r"nope\.safetensors is missing"),
    "duplicate-key": (
        None,
        b'{"weight_map": {"w": "a.safetensors", "w": "a.safetensors"}}',
        CheckpointCorruptError,
        r"has the key 'w' twice",
    ),
    "not-json": (None, b"weight_map", CheckpointCorruptError, r"unreadable safetensors index"),
    "key-not-in-file": (
        {"w": "a.safetensors", "v": "a.safetensors"},
        None,
        CheckpointCorruptError,
        r"a\.safetensors: lacks v",
    ),
}


@pytest.mark.parametrize("case", list(INDEXES), ids=list(INDEXES))
def test_crafted_index_is_refused(tmp_path, case):
    weight_map, raw, error, message = INDEXES[case]
    shards = tmp_path / "st"
    shards.mkdir()
    write_st(shards / "a.safetensors", {"w": F32x6})
    write_st(tmp_path / "model.safetensors", {"w": F32x6})
    directory = write_index(shards, weight_map, raw=raw)
    with pytest.raises(error, match=message) as err:
        open_reader(directory)
    assert "st" in (err.value.path or "")


def test_the_shortest_safetensors_file_is_its_8_byte_length():
    """A safetensors file starts with its header's length in 8 bytes: 8 bytes is the shortest
    file whose length can be read (an empty header; the parser reports what follows), 7 is too
    short, named as such."""
    from ckptlib.format.foreign.safetensors_header import header_length

    assert header_length(struct.pack("<Q", 0), "x.safetensors", 8) == 0
    with pytest.raises(CheckpointCorruptError, match=r"^x\.safetensors: 7 bytes, too short for a safetensors file$"):
        header_length(struct.pack("<Q", 0)[:7], "x.safetensors", 7)
    with pytest.raises(CheckpointCorruptError, match=r"^x\.safetensors: 100 bytes, too short for a safetensors file$"):
        header_length(struct.pack("<Q", 0)[:7], "x.safetensors", 100)  # the file shrank after its size was read


def test_the_smallest_safetensors_header_is_an_empty_object():
    """A safetensors file's header is a JSON object of at least 2 bytes (`{}`: no tensors):
    such a file is still recognised as safetensors, and a 1-byte header is not one."""
    from ckptlib.format.foreign.safetensors import looks_like_safetensors

    empty = struct.pack("<Q", 2) + b"{}"
    assert looks_like_safetensors(empty, len(empty))
    assert not looks_like_safetensors(struct.pack("<Q", 1) + b"{", 9)


def _every_dtype_of_the_format() -> list[str]:
    from ckptlib.format.foreign.safetensors_header import DTYPES

    return [name for name, (attr, _) in DTYPES.items() if hasattr(torch, attr)]


@pytest.mark.parametrize("name", _every_dtype_of_the_format())
def test_every_safetensors_dtype_reads_back_bit_exact(tmp_path, name):
    """A safetensors file written by the `safetensors` package, in each dtype the format and
    torch share, reads back bit-exact through ckptlib's own parser (whole and in a row piece)."""
    pytest.importorskip("safetensors")
    from ckptlib.format.foreign.safetensors_header import DTYPES
    from ckptlib.testing.fakes.legacy_writers import write_safetensors

    dtype = getattr(torch, DTYPES[name][0])
    raw = torch.arange(24, dtype=torch.uint8).repeat(DTYPES[name][1]).reshape(6, 4 * DTYPES[name][1])
    value = raw.view(dtype) if dtype != torch.bool else raw.remainder(2).bool()
    write_safetensors(str(tmp_path), {"w": value})
    reader, info = open_reader(str(tmp_path))
    assert info.metadata.state_dict_metadata["model.w"].properties.dtype == dtype
    (loc,) = [loc for index, loc in reader.storage_data.items() if index.fqn == "model.w"]
    whole = reader._piece(loc, torch.Size([0, 0]), torch.Size(value.shape), "model.w")
    rows = reader._piece(loc, torch.Size([2, 1]), torch.Size([3, 2]), "model.w")
    assert torch.equal(whole.view(torch.uint8), value.view(torch.uint8))
    assert torch.equal(rows.view(torch.uint8), value[2:5, 1:3].contiguous().view(torch.uint8))
