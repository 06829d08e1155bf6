"""Legacy and interchange formats: golden fixtures load at any world size, bit-exactly.

Fixtures live in tests/fixtures/<name>/ (made by tests/fixtures/generate.py, which records
the torch version that wrote each one in fixture.json): plain DCP from torch 2.13, 2.9
(DTensor, FSDP2), 2.1-2.5 (DTensor), 2.0 (ShardedTensor) and 1.13 (ShardedTensor, written
by torch.distributed._shard.checkpoint), ckptlib checkpoints (one per torch minor of the
window that wrote one), torch.save files, a v0 per-rank set at world size 3 and safetensors
(single and sharded). Every one is loaded into a freshly built, differently initialised,
sharded state at 1, 2, 3 and 4 ranks and
compared with its reference.pt, bit for bit: "it loaded" is not enough (DeepSpeed#6691).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch
from helpers.golden import (
    FIXTURE_NAMES,
    FIXTURES,
    check_ranks,
    diff,
    fixture_info,
    fixture_path,
    generator,
    launch_ranks,
    rank_load_and_compare,
    reference,
)
from helpers.readers import IntoTensor

import ckptlib
from ckptlib._torch import dcp_shims
from ckptlib.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    NotACheckpointError,
    ShapeMismatchError,
    StateError,
    UnsafeCheckpointError,
)
from ckptlib.format import CkptReader
from ckptlib.format.source import ForeignReader, SourceInfo, detect_format, inspect_checkpoint, open_reader
from ckptlib.offline.convert import convert
from ckptlib.state.state import _merge_back
from ckptlib.testing.fakes.legacy_writers import uneven_bounds, write_safetensors, write_v0

pytestmark = pytest.mark.legacy

WORLD_SIZES = (1, 2, 3, 4)


# --------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda w: f"load-ws{w}")
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_loads_bit_exact(name, world_size):
    results = launch_ranks(world_size, rank_load_and_compare, name)
    check_ranks(results, name)
    info = fixture_info(name)
    assert {r["format"] for r in results} == {info["format"]}
    assert {r["world_size"] for r in results} == {info["saved_world_size"]}
    assert all(r["missing"] == [] for r in results)


def test_pre_24_flattened_objects_load():
    """torch 2.0 saved {'meta': {...}} as one bytes item 'meta'; DCP reads it with its pre-2.4
    fallback, and so does ckptlib.load (pytorch/pytorch#133923)."""
    results = launch_ranks(2, rank_load_and_compare, "dcp_sharded_tensor_torch2.0")
    check_ranks(results, "dcp_sharded_tensor_torch2.0")
    assert all(r["diffs"] == [] for r in results)


def test_pre_24_flattened_objects_merge_back_every_value():
    """The dict DCP puts in place of a pre-2.4 'meta' is copied back value by value, past a
    value the state already had (the same int object, skipped) to the ones that differ."""
    meta = {"epoch": 3, "tag": "wrong"}
    ckptlib.load(fixture_path("dcp_sharded_tensor_torch2.0"), {"meta": meta})
    assert meta == {"epoch": 3, "tag": "golden"}
    meta = {"epoch": {"a dict": "where the checkpoint has an int"}, "tag": "wrong"}
    ckptlib.load(fixture_path("dcp_sharded_tensor_torch2.0"), {"meta": meta})
    assert meta == {"epoch": 3, "tag": "golden"}


def test_pre_24_keys_still_check_shapes():
    """Where the pre-2.4 key rules match the checkpoint better (its 'meta' is one item), the
    state's tensors are still checked against it: a wrong shape is a ShapeMismatchError naming
    the key, not a load of the wrong tensor."""
    meta = {"epoch": 0, "tag": ""}
    with pytest.raises(ShapeMismatchError) as caught:
        ckptlib.load(
            fixture_path("dcp_sharded_tensor_torch2.0"),
            {"meta": meta, "model": {"head": {"bias": torch.zeros(3)}}},
            strict=False,
        )
    assert caught.value.keys == ["model.head.bias"]
    assert "model.head.bias: shape (3,) in the state, (2,) in the checkpoint" in str(caught.value)
    assert meta == {"epoch": 0, "tag": ""}


@pytest.mark.parametrize("fmt", ["safetensors", "torch_save"])
def test_a_piece_of_a_foreign_tensor_is_cut_in_every_dimension(tmp_path, fmt):
    """A resharded load asks a foreign source for a box of a tensor (a tensor-parallel column
    shard, say): the rows come from one read, and every other dimension is cut to the box."""
    w = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6)
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
        path = str(tmp_path / "st")
        write_safetensors(path, {"w": w})  # read back as model.w
    else:
        path = str(tmp_path / "w.pt")
        torch.save({"model": {"w": w}}, path)
    reader, _ = open_reader(path)
    (loc,) = [loc for index, loc in reader.storage_data.items() if index.fqn == "model.w"]
    piece = reader._piece(loc, torch.Size([1, 2, 3]), torch.Size([1, 2, 3]), "model.w")
    assert torch.equal(piece, w[1:2, 2:4, 3:6])


@pytest.mark.parametrize("field", ["offsets", "global_shape", "local"])
def test_a_v0_shard_record_missing_a_field_value_is_corrupt(tmp_path, field):
    """A v0 per-rank record whose offsets, global shape or local tensor is not what it must be
    (a list of ints, a tensor) is a CheckpointCorruptError naming the file and key."""
    write_v0(str(tmp_path), {"model": {"w": torch.arange(8.0)}}, 2)
    doc = torch.load(tmp_path / "rank_1.pt", weights_only=True)
    doc["tensors"]["model"]["w"][field] = "x"
    torch.save(doc, tmp_path / "rank_1.pt")
    with pytest.raises(CheckpointCorruptError, match=r"rank_1\.pt: model\.w: malformed shard record"):
        open_reader(str(tmp_path))


def test_merge_back_keeps_the_callers_objects():
    """What a load hands back into a dict DCP replaced: nested dicts merged into the caller's
    own dicts and same-shape tensors copied into the caller's tensors (both stay the objects
    the caller holds); anything else, a tensor of another shape included, replaced."""
    inner, weight, other = {"kept": 1, "old": 2}, torch.zeros(3), torch.zeros(2)
    dst = {"inner": inner, "weight": weight, "other": other, "number": torch.ones(1), "plain": {"a": 1}}
    src = {
        "inner": {"old": 20, "new": 30},
        "weight": torch.arange(3.0),
        "other": torch.arange(4.0),
        "number": 5,
        "plain": 7,
    }
    _merge_back(dst, src)
    assert dst["inner"] is inner and inner == {"kept": 1, "old": 20, "new": 30}
    assert dst["weight"] is weight and torch.equal(weight, torch.arange(3.0))
    assert torch.equal(dst["other"], torch.arange(4.0)) and torch.equal(other, torch.zeros(2))
    assert dst["number"] == 5 and dst["plain"] == 7
    dst = {"was_int": 1}
    _merge_back(dst, {"was_int": {"now": "a dict"}})
    assert dst == {"was_int": {"now": "a dict"}}


def test_every_kind_of_fixture_is_present():
    kinds = {(fixture_info(n)["format"]) for n in FIXTURE_NAMES}
    assert kinds == {"ckptlib", "dcp", "torch_save", "v0", "safetensors"}
    versions = {fixture_info(n)["torch_version"].split("+")[0].rsplit(".", 1)[0] for n in FIXTURE_NAMES}
    assert {"1.13", "2.0", "2.9"} <= versions, versions  # golden checkpoints from older torch
    for n in FIXTURE_NAMES:
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(FIXTURES, n)) for f in fs)
        assert size < 200_000, f"{n} is {size} bytes: keep fixtures small"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_detect_format(name):
    assert detect_format(fixture_path(name)) == fixture_info(name)["format"]


def test_v0_loads_single_process_in_any_layout(tmp_path):
    """The v0 definition's variants: flat dotted keys, empty pieces left out, all replicated."""
    ref = reference("torch_save")
    for variant, kwargs in {
        "flat": {"flat_keys": True},
        "skip_empty": {"skip_empty": True},
        "replicated": {"split_dim": lambda fqn, t: None},
        "dim1": {"split_dim": lambda fqn, t: 1 if t.dim() > 1 else (0 if t.dim() else None)},
        "many_ranks": {"world": 9},
    }.items():
        path = str(tmp_path / variant)
        world = kwargs.pop("world", 4)
        write_v0(path, ref, world, **kwargs)
        assert detect_format(path) == "v0"
        got = convert(path, str(tmp_path / f"{variant}.pt"), to="torch", progress=False)
        assert got.src_format == "v0"
        loaded = torch.load(tmp_path / f"{variant}.pt", weights_only=True)
        flat_loaded = dcp_shims.flatten_state_dict(loaded)[0]
        assert diff(flat_loaded, dcp_shims.flatten_state_dict(ref)[0]) == [], variant
        if variant == "flat":
            assert "model.proj.weight" in loaded  # nesting comes out as written: flat keys stay flat
        else:
            assert diff(loaded, ref) == [], variant


def test_uneven_bounds():
    assert uneven_bounds(7, 3) == [0, 1, 4, 7]
    assert uneven_bounds(2, 3) == [0, 0, 1, 2]
    assert uneven_bounds(5, 1) == [0, 5]


# --------------------------------------------------------------------------- plain DCP semantics


def test_plain_dcp_loads_and_says_no_checksums(tmp_path):
    """A DCP directory without manifest loads through ckptlib.load as format 'dcp': no
    checksums, so a flipped payload byte is not detected, where a ckptlib checkpoint is."""
    import torch.distributed.checkpoint as dcp

    ref = reference("torch_save")
    plain = str(tmp_path / "plain")
    with pytest.warns(UserWarning):
        dcp.save({"extra": dict(ref["extra"])}, storage_writer=dcp.FileSystemWriter(plain))
    state = {"extra": {k: torch.zeros_like(v) for k, v in ref["extra"].items()}}
    result = ckptlib.load(plain, state)
    assert result.format == "dcp" and result.metadata == {} and result.step is None
    assert diff(state["extra"], ref["extra"]) == []

    makers = {
        "dcp": lambda p: shutil.copytree(plain, p),
        "ckptlib": lambda p: ckptlib.save(p, {"extra": dict(ref["extra"])}),
    }
    for kind, make in makers.items():
        target = str(tmp_path / f"flipped-{kind}")
        make(target)
        _flip_tensor_byte(target, "extra.ids")
        state = {"extra": {k: torch.zeros_like(v) for k, v in ref["extra"].items()}}
        if kind == "dcp":
            assert ckptlib.load(target, state).format == "dcp"
            assert diff(state["extra"], ref["extra"]) == [".ids: values differ"]  # silently wrong
        else:
            with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
                ckptlib.load(target, state)


def _flip_tensor_byte(directory: str, fqn: str) -> None:
    """Flip one bit of `fqn`'s tensor data inside its DCP item (a torch.save blob)."""
    import io

    from ckptlib.format import read_metadata
    from ckptlib.storage import open_storage

    md = read_metadata(open_storage(directory), None)
    (index,) = [i for i in md.storage_data if i.fqn == fqn]
    info = md.storage_data[index]
    path = os.path.join(directory, info.relative_path)
    with open(path, "rb") as f:
        f.seek(info.offset)
        blob = bytearray(f.read(info.length))
    raw = torch.load(io.BytesIO(bytes(blob)), weights_only=True).contiguous().view(torch.uint8).numpy().tobytes()
    at = blob.find(raw)
    assert at > 0, "tensor payload not found in the item"
    blob[at] ^= 0x01
    with open(path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(blob))


# --------------------------------------------------------------------------- readers


def test_open_reader_kinds():
    for name in FIXTURE_NAMES:
        reader, info = open_reader(fixture_path(name))
        kind = fixture_info(name)["format"]
        assert info.kind == kind
        assert isinstance(reader, CkptReader if kind in ("ckptlib", "dcp") else ForeignReader)


@pytest.mark.parametrize("name", ["torch_save", "v0_ws3", "safetensors_sharded"])
def test_source_info_is_small_and_rebuilds_the_reader(name):
    """Rank 0 inspects, every rank builds its reader from the broadcast info, without I/O."""
    info = inspect_checkpoint(fixture_path(name))
    assert isinstance(info, SourceInfo)
    blob = pickle.dumps(info)
    assert len(blob) < 20_000  # locators only, never tensor data
    again = pickle.loads(blob)
    reader, same = open_reader(fixture_path(name), info=again)
    assert same is again and isinstance(reader, ForeignReader)
    pickle.loads(pickle.dumps(reader))  # readers cross process boundaries too


@pytest.mark.parametrize("name", ["torch_save", "v0_ws3", "safetensors_single"])
def test_reader_reads_only_the_rows_a_rank_needs(name):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    reader, info = open_reader(fixture_path(name))
    fqn = "model.embed.weight"
    md = info.metadata.state_dict_metadata[fqn]
    want = ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([3, 4]))
    items = create_read_items_for_chunk_list(fqn, md, [want])
    out = torch.zeros(3, 4)
    for item in items:  # one target per item, placed by its dest offsets
        view = out.narrow(0, item.dest_offsets[0], item.lengths[0]).narrow(1, item.dest_offsets[1], item.lengths[1])
        reader.read_data(LoadPlan([item]), IntoTensor(view)).wait()
    assert torch.equal(out, reference(name)["model"]["embed.weight"][2:5])
    assert reader.bytes_read == 3 * 4 * 4  # three rows of four float32, nothing else


def test_safetensors_fixture_all_tensors_single_process():
    """Every safetensors tensor (incl. a bf16 one no model holds), loaded flat into one process."""
    import torch.distributed.checkpoint as dcp

    from ckptlib.format import SafeLoadPlanner

    for name in ("safetensors_single", "safetensors_sharded"):
        ref = reference(name)["model"]
        reader, info = open_reader(fixture_path(name))
        template = {f"model.{k}": torch.zeros_like(v) for k, v in ref.items()}
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner())
        assert diff({k[len("model.") :]: v for k, v in template.items()}, ref) == []
    assert any(v.dtype == torch.bfloat16 for v in reference("safetensors_sharded")["model"].values())


# --------------------------------------------------------------------------- converters


def _round_trip(src: str, tmp_path, chain: list[str]) -> str:
    current = src
    for i, to in enumerate(chain):
        dst = str(tmp_path / f"step{i}-{to}") + (".pt" if to == "torch" else "")
        result = convert(current, dst, to=to, progress=False)
        assert result.to == to and result.tensors > 0
        current = dst
    return current


@pytest.mark.parametrize(
    "name,chain",
    [
        ("ckptlib", ["torch", "dcp"]),
        ("torch_save", ["dcp", "torch"]),
        ("v0_ws3", ["dcp"]),
        ("v0_ws3", ["torch"]),
        ("safetensors_sharded", ["dcp", "torch"]),
        ("safetensors_single", ["dcp"]),
        ("dcp_sharded_tensor_torch2.0", ["dcp", "torch"]),
        ("torch_save_model_only", ["safetensors", "dcp"]),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, list) else v,
)
def test_convert_round_trip_values_equal(name, chain, tmp_path):
    out = _round_trip(fixture_path(name), tmp_path, chain)
    ref = reference(name)
    if chain[-1] == "torch":
        got = torch.load(out, weights_only=True)
    else:
        reader, info = open_reader(out)
        torch_out = str(tmp_path / "final.pt")
        convert(out, torch_out, to="torch", progress=False)
        got = torch.load(torch_out, weights_only=True)
        assert info.kind == ("ckptlib" if chain[-1] == "dcp" else chain[-1])
    if name.startswith("dcp_sharded_tensor_torch2.0"):
        assert got["meta"] == ref["meta"]  # the pre-2.4 bytes item comes out nested again
    assert diff(got, ref) == []


def test_converted_checkpoint_loads_sharded(tmp_path):
    """v0 (world size 3) -> ckptlib -> loaded at world size 2 through ckptlib.load."""
    dst = str(tmp_path / "from-v0")
    result = convert(fixture_path("v0_ws3"), dst, to="dcp", progress=False)
    assert result.src_format == "v0" and detect_format(dst) == "ckptlib"
    results = launch_ranks(2, rank_load_and_compare, "v0_ws3", dst)
    check_ranks(results, "converted v0")
    assert {r["format"] for r in results} == {"ckptlib"}


def test_convert_upgrades_pre_24_keys(tmp_path):
    """Converting the torch 2.0 fixture re-flattens 'meta' with current rules, so the result
    is keyed by current rules and needs no pre-2.4 fallback."""
    dst = str(tmp_path / "upgraded")
    convert(fixture_path("dcp_sharded_tensor_torch2.0"), dst, progress=False)
    results = launch_ranks(2, rank_load_and_compare, "dcp_sharded_tensor_torch2.0", dst)
    check_ranks(results, "upgraded 2.0")


def test_convert_to_safetensors_is_readable_by_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    ref = reference("torch_save")
    single = tmp_path / "single"
    result = convert(fixture_path("torch_save"), str(single), to="safetensors", progress=False)
    assert result.files == ["model.safetensors"]
    assert result.skipped and all(not k.startswith("model.") for k in result.skipped)
    assert diff(st.load_file(str(single / "model.safetensors")), ref["model"]) == []

    sharded = tmp_path / "sharded"
    result = convert(fixture_path("torch_save"), str(sharded), to="safetensors", progress=False, max_shard_size=64)
    assert "model.safetensors.index.json" in result.files and len(result.files) > 2
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(st.load_file(str(sharded / file)))
    assert diff(loaded, ref["model"]) == []
    assert detect_format(str(sharded)) == "safetensors"

    one_file = tmp_path / "named.safetensors"
    convert(fixture_path("safetensors_sharded"), str(one_file), to="safetensors", progress=False)
    assert diff(st.load_file(str(one_file)), reference("safetensors_sharded")["model"]) == []


def test_convert_refuses_to_overwrite(tmp_path):
    src = fixture_path("torch_save")
    targets = {"dcp": str(tmp_path / "d"), "torch": str(tmp_path / "t.pt"), "safetensors": str(tmp_path / "s")}
    for to, dst in targets.items():
        convert(src, dst, to=to, progress=False)
        with pytest.raises(CheckpointExistsError) as err:
            convert(src, dst, to=to, progress=False)
        assert dst in str(err.value) or os.path.abspath(dst) in str(err.value)
        convert(src, dst, to=to, force=True, progress=False)  # force overwrites
    with pytest.raises(StateError, match="onto itself"):
        convert(targets["dcp"], targets["dcp"], force=True, progress=False)
    with pytest.raises(ValueError, match="to must be one of"):
        convert(src, str(tmp_path / "x"), to="onnx")


def test_convert_progress_bar(tmp_path, capsys):
    convert(fixture_path("v0_ws3"), str(tmp_path / "out"), progress=True)
    assert "v0 -> dcp" in capsys.readouterr().err


def test_convert_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Streaming: every tensor is fetched once, on its own, and released before the next."""
    import weakref

    from ckptlib.format import streaming

    live: list = []
    fetched: list = []
    original = streaming.SourceValues.tensor

    def tracking(self, fqn):
        tensor = original(self, fqn)
        alive = [r for r in live if r() is not None]
        fetched.append((fqn, len(alive)))
        live.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(streaming.SourceValues, "tensor", tracking)
    # CkptWriter's loop still holds the previous item while it asks for the next one, so a
    # DCP target has at most two tensors alive; the file writers only ever one.
    for to, dst, most in (("dcp", "d", 1), ("safetensors", "s", 0), ("torch", "t.pt", 0)):
        fetched.clear()
        live.clear()
        result = convert(fixture_path("torch_save"), str(tmp_path / dst), to=to, progress=False)
        assert len(fetched) == result.tensors == len({f for f, _ in fetched})
        assert max(n for _, n in fetched) <= most, (to, fetched)


# --------------------------------------------------------------------------- errors


def test_unknown_format_names_the_path(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    (junk / "weights.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(NotACheckpointError) as err:
        detect_format(str(junk))
    assert str(junk) in str(err.value) and "notes.txt" in str(err.value)
    with pytest.raises(NotACheckpointError, match=str(junk)):
        ckptlib.load(str(junk), {"x": torch.zeros(1)})
    with pytest.raises(NotACheckpointError, match=str(junk / "notes.txt")):
        detect_format(str(junk / "notes.txt"))
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "absent")):
        detect_format(str(tmp_path / "absent"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NotACheckpointError, match=str(empty)):
        detect_format(str(empty))


def test_incomplete_checkpoint_is_not_guessed_at(tmp_path):
    """A crashed ckptlib/DCP save stays CheckpointIncompleteError, even if other files are there."""
    from ckptlib.errors import CheckpointIncompleteError

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "ckptlib.pending").write_text("{}")
    (crashed / "__0_0.distcp").write_bytes(b"x")
    (crashed / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointIncompleteError, match=str(crashed)):
        detect_format(str(crashed))


def test_v0_missing_rank_file(tmp_path):
    v0 = tmp_path / "v0"
    shutil.copytree(fixture_path("v0_ws3"), v0)
    (v0 / "rank_1.pt").unlink()
    with pytest.raises(CheckpointCorruptError) as err:
        open_reader(str(v0))
    assert str(v0 / "rank_1.pt") in str(err.value) and "world_size=3" in str(err.value)
    assert err.value.path == str(v0 / "rank_1.pt")
    with pytest.raises(NotACheckpointError, match="pass the directory"):
        detect_format(str(v0 / "rank_0.pt"))


def test_v0_gap_and_overlap_are_corrupt(tmp_path):
    ref = {"model": {"w": torch.arange(12.0).reshape(6, 2)}}
    gap = str(tmp_path / "gap")
    write_v0(gap, ref, 3)
    doc = torch.load(os.path.join(gap, "rank_2.pt"), weights_only=True)
    doc["tensors"]["model"]["w"]["local"] = doc["tensors"]["model"]["w"]["local"][:1]  # 2 of its 3 rows lost
    torch.save(doc, os.path.join(gap, "rank_2.pt"))
    with pytest.raises(CheckpointCorruptError, match=r"pieces of model\.w cover 8 of its 12"):
        open_reader(gap)
    overlap = str(tmp_path / "overlap")
    write_v0(overlap, ref, 3)
    doc = torch.load(os.path.join(overlap, "rank_1.pt"), weights_only=True)
    doc["tensors"]["model"]["w"]["offsets"] = [0, 0]
    torch.save(doc, os.path.join(overlap, "rank_1.pt"))
    with pytest.raises(CheckpointCorruptError, match=r"pieces of model\.w overlap"):
        open_reader(overlap)
    wrong = str(tmp_path / "wrong")
    write_v0(wrong, ref, 2)
    doc = torch.load(os.path.join(wrong, "rank_1.pt"), weights_only=True)
    doc["world_size"] = 4
    torch.save(doc, os.path.join(wrong, "rank_1.pt"))
    with pytest.raises(CheckpointCorruptError, match="rank_1.pt: says world_size=4"):
        open_reader(wrong)


def test_safetensors_index_naming_a_missing_file(tmp_path):
    st = tmp_path / "st"
    shutil.copytree(fixture_path("safetensors_sharded"), st)
    index = json.loads((st / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (st / gone).unlink()
    assert detect_format(str(st)) == "safetensors"
    with pytest.raises(CheckpointCorruptError) as err:
        open_reader(str(st))
    assert str(st / gone) in str(err.value) and "model.safetensors.index.json" in str(err.value)
    assert err.value.path == str(st / gone)


def test_safetensors_truncated_or_lying_header(tmp_path):
    pytest.importorskip("safetensors")
    st = tmp_path / "st"
    write_safetensors(str(st), {"w": torch.arange(6.0)})
    data = (st / "model.safetensors").read_bytes()
    (st / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(
        CheckpointCorruptError,
        match=r"model\.safetensors: tensor 'w': data_offsets end at 24, past the 20-byte data section",
    ):
        open_reader(str(st))
    (st / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(CheckpointCorruptError, match="header length"):
        open_reader(str(st))


def test_torch_save_needing_arbitrary_unpickling_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "cfg": _Custom()}, path)
    assert detect_format(str(path)) == "torch_save"
    with pytest.raises(UnsafeCheckpointError, match="trusted=True"):
        open_reader(str(path))
    reader, info = open_reader(str(path), trusted=True)
    assert "model.w" in info.metadata.state_dict_metadata


class _Custom:
    pass


def test_a_torch_save_file_without_a_local_path_is_read_whole_with_its_note(tmp_path):
    """A torch.save file on storage without a local path (an object store) is read whole into
    memory: the load notes it when asked for notes, and works the same without."""
    from ckptlib.format.foreign.torch_save import torch_load
    from ckptlib.storage import open_storage

    torch.save({"w": torch.arange(3.0)}, tmp_path / "w.pt")
    root = open_storage(str(tmp_path))
    root.local_path = lambda name: None
    notes: list[str] = []
    assert torch.equal(torch_load(root, "w.pt", trusted=False, notes=notes)["w"], torch.arange(3.0))
    assert notes == [f"{root.uri}/w.pt: not a local file, read whole into memory"]
    assert torch.equal(torch_load(root, "w.pt", trusted=False)["w"], torch.arange(3.0))


def test_legacy_pre_zip_torch_save_is_read_into_memory(tmp_path):
    """torch.save's pre-1.6 format (not a zip archive; still written with
    `_use_new_zipfile_serialization=False`) cannot be memory-mapped: it is read into memory
    instead, bit-exact, and the load says so."""
    path = tmp_path / "old.pt"
    weight = torch.arange(6.0).reshape(2, 3)
    torch.save({"model": {"w": weight}, "step": 7}, path, _use_new_zipfile_serialization=False)
    assert detect_format(str(path)) == "torch_save"
    model = {"w": torch.zeros(2, 3)}
    state = {"model": model, "step": 0}
    result = ckptlib.load(str(path), state)
    assert torch.equal(model["w"], weight) and state["step"] == 7
    assert result.notes == [f"{path}: legacy (pre-zip) torch.save format, read into memory (no mmap)"]


# --------------------------------------------------------------------------- keys must match, loudly


def test_renamed_keys_fail_loudly(tmp_path):
    """A key-flattening change (pytorch/pytorch#133923) must be a MissingKeysError naming the
    keys, never a silent load of wrong or default values."""
    ref = reference("torch_save")
    renamed = {**ref, "model": {k.replace("proj.", "proj_"): v for k, v in ref["model"].items()}}
    path = str(tmp_path / "renamed.pt")
    torch.save(renamed, path)
    results = launch_ranks(2, rank_load_and_compare, "torch_save", path)
    assert all(r.get("error") == "MissingKeysError" for r in results), results
    assert "model.proj.weight" in results[0]["message"] and "model.proj.bias" in results[0]["message"]


def test_hf_style_prefixed_safetensors_fail_loudly(tmp_path):
    """safetensors whose keys already carry 'model.' map to 'model.model.*': MissingKeysError."""
    pytest.importorskip("safetensors")
    st = str(tmp_path / "hf")
    write_safetensors(st, {f"model.{k}": v for k, v in reference("safetensors_single")["model"].items()})
    results = launch_ranks(1, rank_load_and_compare, "safetensors_single", st)
    assert results[0].get("error") == "MissingKeysError", results
    assert "model.embed.weight" in results[0]["message"]


def test_raw_optimizer_state_dict_fails_loudly(tmp_path):
    """torch.save of optimizer.state_dict() (integer parameter ids) is not FQN-keyed: loud."""
    gen = generator()
    model = gen.build_model()
    optim = gen.make_optim(model)
    gen.train(model, optim)
    path = str(tmp_path / "raw.pt")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    results = launch_ranks(1, rank_load_and_compare, "torch_save", path, ("extra", "meta"))
    assert results[0].get("error") == "MissingKeysError", results
    assert "optim.state.embed.weight" in results[0]["message"]
