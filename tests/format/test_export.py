"""`ckptlib.export` / `ckpt export`: a consolidated model in Hugging Face's layout, from any
source world size, read back bit-exactly by the `safetensors` package and `torch.load`, with
bounded memory and an overwrite rule that never touches files ckptlib did not write."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.errors import CheckpointExistsError, StateError
from ckptlib.offline.export import EXPORT_RECORD, parse_size
from ckptlib.testing.matrices.matrix import save_side

st = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_export(directory: str, fmt: str) -> dict[str, torch.Tensor]:
    """Load an export the way transformers does: the index's weight_map (every file it names
    must exist and hold exactly the tensors mapped to it), or the single weights file."""
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    index_path = os.path.join(directory, f"{stem}.{ext}.index.json")

    def load_file(name: str) -> dict[str, torch.Tensor]:
        path = os.path.join(directory, name)
        if fmt == "safetensors":
            with safe_open(path, framework="pt") as f:
                assert f.metadata()["format"] == "pt"  # transformers refuses other formats
            return st.load_file(path)
        return torch.load(path, weights_only=True, mmap=True)

    if not os.path.exists(index_path):
        return load_file(f"{stem}.{ext}")
    with open(index_path) as f:
        index = json.load(f)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors = load_file(name)
        assert sorted(tensors) == sorted(k for k, v in index["weight_map"].items() if v == name)
        out.update(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype, key
        assert torch.equal(actual[key], value), key


def _save_manager(root: str) -> dict:
    return save_side(root, "fsdp2", "adamw", manager=True)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"save{n}-fsdp2")
def test_model_only_export_from_any_world_size_is_bit_exact(tmp_path, dist_run, world_size, fmt):
    root = str(tmp_path / "run")
    expected = dist_run(world_size, _save_manager, root)[0]
    out = str(tmp_path / "hf")
    result = ckptlib.export(root, out, format=fmt, model_only=True)  # a manager root: its latest step
    assert result.step == 2 and result.world_size == world_size and result.src_format == "ckptlib"
    weights = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    assert sorted(os.listdir(out)) == sorted([weights, EXPORT_RECORD])  # one shard: no index, as HF does
    assert_same(expected["model"], read_export(out, fmt))
    assert result.bytes == sum(t.numel() * t.element_size() for t in expected["model"].values())
    assert result.tensors == len(expected["model"])
    assert "step" in result.skipped and all(not k.startswith("model.") for k in result.skipped)


def test_full_export_keeps_full_keys_and_optimizer_tensors(tmp_path, dist_run):
    src = str(tmp_path / "ckpt")
    expected = dist_run(2, save_side, src, "fsdp2", "adamw")[0]
    out = str(tmp_path / "all")
    ckptlib.export(src, out, model_only=False)
    got = read_export(out, "safetensors")
    want = {f"model.{k}": v for k, v in expected["model"].items()}
    for param, slots in expected["optim"]["state"].items():
        for slot, value in slots.items():
            want[f"optim.state.{param}.{slot}"] = value
    assert_same(want, got)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_sharding_follows_hugging_face_layout(tmp_path, fmt):
    tensors = {f"layer{i}.weight": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    tensors["big"] = torch.arange(300, dtype=torch.float32)  # 1200 bytes: larger than a shard
    ckptlib.save(str(tmp_path / "c"), {"model": tensors})
    out = str(tmp_path / "hf")
    result = ckptlib.export(str(tmp_path / "c"), out, format=fmt, model_only=True, max_shard_size=1000)
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    shards = [f for f in result.files if f.endswith("." + ext)]
    assert shards == [f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}" for i in range(1, len(shards) + 1)]
    assert result.files == shards + [f"{stem}.{ext}.index.json"]
    assert sorted(os.listdir(out)) == sorted(result.files + [EXPORT_RECORD])
    index = json.loads((tmp_path / "hf" / f"{stem}.{ext}.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 400 + 1200 == result.bytes
    assert sorted(index["weight_map"]) == sorted(tensors)
    for shard in shards:
        size = sum(tensors[k].numel() * 4 for k, v in index["weight_map"].items() if v == shard)
        assert size <= 1000 or size == 1200  # the big tensor alone in its shard
    assert_same(tensors, read_export(out, fmt))
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record["complete"] is True and record["files"] == result.files


@pytest.mark.parametrize("size", [1000, "1KB"], ids=["bytes", "string"])
def test_convert_shards_through_the_same_writer_as_export(tmp_path, size):
    """convert --to safetensors and export write through one writer path: the same knob
    (max_shard_size, bytes or "1KB"), the same shards and index byte for byte."""
    from ckptlib.offline.convert import convert

    tensors = {f"layer{i}.weight": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    ckptlib.save(str(tmp_path / "c"), {"model": tensors, "optim": {"lr": torch.tensor(0.1)}})
    exported, converted = (str(tmp_path / name) for name in ("exported", "converted"))
    result = ckptlib.export(str(tmp_path / "c"), exported, model_only=True, max_shard_size=size)
    done = convert(str(tmp_path / "c"), converted, to="safetensors", max_shard_size=size)
    assert done.files == result.files and len(result.files) == 4  # 3 shards and the index
    for name in result.files:
        assert open(os.path.join(exported, name), "rb").read() == open(os.path.join(converted, name), "rb").read()
    record = json.loads(open(os.path.join(converted, EXPORT_RECORD)).read())
    assert record["complete"] is True and record["files"] == result.files and record["export_format"] == "safetensors"
    one = convert(str(tmp_path / "c"), str(tmp_path / "default"), to="safetensors")  # 5GB, as export's default
    assert one.files == ["model.safetensors"]


def _damage_item(src, fqn: str) -> None:
    """Flip the last byte of `fqn`'s item in its shard file (its checksum no longer matches)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = FileSystemReader(str(src)).read_metadata().storage_data[MetadataIndex(fqn, [0])]
    path = src / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset + info.length - 1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_a_failed_export_removes_what_it_wrote(tmp_path, fmt):
    """A failure after some shards were written (a damaged item in the last one) removes those
    shards: a new directory goes, an existing one keeps the user's files and the record, marked
    incomplete, so the next forced export may write there again (without it the directory
    would be a user's, refused even with force: found by the crash harness)."""
    src = tmp_path / "c"
    ckptlib.save(str(src), {"model": {f"t{i}": torch.full((100,), float(i)) for i in range(4)}})
    out = tmp_path / "hf"
    ckptlib.export(str(src), str(out), format=fmt, model_only=True, max_shard_size=500)
    (out / "config.json").write_text("{}")
    _damage_item(src, "model.t3")
    for target, force in ((tmp_path / "new", False), (out, True)):
        with pytest.raises(ckptlib.CheckpointCorruptError, match="checksum mismatch"):
            ckptlib.export(str(src), str(target), format=fmt, model_only=True, max_shard_size=500, force=force)
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(out)) == ["ckptlib_export.json", "config.json"]  # the old export was replaced
    assert json.loads((out / "ckptlib_export.json").read_text())["complete"] is False
    ckptlib.save(str(src), {"model": {f"t{i}": torch.full((100,), float(i)) for i in range(4)}}, overwrite=True)
    ckptlib.export(str(src), str(out), format=fmt, model_only=True, max_shard_size=500, force=True)
    assert json.loads((out / "ckptlib_export.json").read_text())["complete"] is True


def test_export_of_a_damaged_item_is_the_checksum_error_naming_it(tmp_path):
    """export streams tensors through DCP's loader: a damaged item comes out as ckptlib's
    CheckpointCorruptError naming the file and item (unwrapped from DCP's CheckpointException),
    and nothing is published."""
    src = tmp_path / "c"
    ckptlib.save(str(src), {"model": {"w": torch.arange(1000.0)}})
    ((offset, length, _),) = json.loads((src / "ckptlib.json").read_text())["files"]["__0_0.distcp"]["items"]
    data = bytearray((src / "__0_0.distcp").read_bytes())
    data[offset + length - 1] ^= 0xFF
    (src / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(
        ckptlib.CheckpointCorruptError,
        match=rf"__0_0\.distcp: checksum mismatch in tensor 'model\.w' at offset {offset} \(length {length}\)",
    ):
        ckptlib.export(str(src), str(tmp_path / "hf"), model_only=True)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_convert_and_export_mark_their_single_files_and_replace_only_those(tmp_path, fmt):
    """export and convert write one file through one writer path, marked as ckptlib's (what
    lets a later export or convert with force replace it); a file of the same kind written by
    anyone else carries no mark and is never replaced, force or not."""
    from safetensors.torch import save_file

    from ckptlib.errors import OverwriteRefusedError
    from ckptlib.offline.convert import convert

    src = str(tmp_path / "c")
    ckptlib.save(src, {"model": {"w": torch.arange(6.0)}})
    suffix = ".safetensors" if fmt == "safetensors" else ".pt"
    exported, converted, theirs = (str(tmp_path / f"{name}{suffix}") for name in ("exported", "converted", "theirs"))
    ckptlib.export(src, exported, format=fmt, model_only=True)
    convert(src, converted, to=fmt)
    if fmt == "safetensors":
        save_file({"w": torch.zeros(6)}, theirs)
        for path in (exported, converted):
            with safe_open(path, "pt") as f:
                assert (f.metadata() or {}).get("ckptlib_export") == "1"
        assert torch.equal(st.load_file(converted)["w"], torch.arange(6.0))
    else:
        torch.save({"model": {"w": torch.zeros(6)}}, theirs)
        assert torch.equal(torch.load(converted, weights_only=True)["model"]["w"], torch.arange(6.0))
        assert torch.equal(torch.load(converted, mmap=True, weights_only=True)["model"]["w"], torch.arange(6.0))
    # either writer replaces the other's file with force, never without
    with pytest.raises(CheckpointExistsError, match="already exists .*force"):
        convert(src, exported, to=fmt)
    convert(src, exported, to=fmt, force=True)
    ckptlib.export(src, converted, format=fmt, model_only=True, force=True)
    before = open(theirs, "rb").read()
    with pytest.raises(
        OverwriteRefusedError, match="not an export ckptlib wrote; refusing to overwrite it even with force"
    ):
        convert(src, theirs, to=fmt, force=True)
    with pytest.raises(OverwriteRefusedError, match="not an export ckptlib wrote"):
        ckptlib.export(src, theirs, format=fmt, model_only=True, force=True)
    assert open(theirs, "rb").read() == before


def test_safetensors_tensors_are_aligned_to_their_element_size(tmp_path):
    """export writes larger elements first (as the safetensors package does), so every tensor's
    bytes start at a multiple of its element size and readers can map them without a copy."""
    src = str(tmp_path / "c")
    ckptlib.save(
        src,
        {
            "model": {
                "a_mask": torch.ones(3, dtype=torch.bool),
                "b_half": torch.ones(3, dtype=torch.float16),
                "c_float": torch.ones(3),
                "d_double": torch.ones(3, dtype=torch.float64),
            }
        },
    )
    ckptlib.export(src, str(tmp_path / "hf"), model_only=True)
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    sizes = {"BOOL": 1, "F16": 2, "F32": 4, "F64": 8}
    starts = {name: entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}
    assert all(starts[name] % sizes[header[name]["dtype"]] == 0 for name in starts), header
    assert sorted(starts, key=starts.get) == ["d_double", "c_float", "b_half", "a_mask"]


def test_a_shard_is_filled_up_to_exactly_the_limit(tmp_path):
    """Tensors that fill a shard exactly to max_shard_size share it (the limit is inclusive,
    as Hugging Face's): five 400-byte tensors at 800 bytes a shard make shards of 2, 2, 1."""
    tensors = {f"layer{i}.weight": torch.full((100,), float(i)) for i in range(5)}
    ckptlib.save(str(tmp_path / "c"), {"model": tensors})
    out = tmp_path / "hf"
    ckptlib.export(str(tmp_path / "c"), str(out), model_only=True, max_shard_size=800)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    assert sorted(sorted(names) for names in by_shard.values()) == [
        ["layer0.weight", "layer1.weight"],
        ["layer2.weight", "layer3.weight"],
        ["layer4.weight"],
    ]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_dtype_casts_floating_point_tensors_only(tmp_path, fmt):
    model = {"w": torch.randn(4, 8), "h": torch.randn(3, dtype=torch.float64), "count": torch.arange(6)}
    ckptlib.save(str(tmp_path / "c"), {"model": model})
    out = str(tmp_path / "o")
    result = ckptlib.export(str(tmp_path / "c"), out, format=fmt, model_only=True, dtype="bfloat16")
    got = read_export(out, fmt)
    assert result.dtype == "bfloat16"
    assert_same({"w": model["w"].to(torch.bfloat16), "h": model["h"].to(torch.bfloat16), "count": model["count"]}, got)
    assert result.bytes == 32 * 2 + 3 * 2 + 6 * 8


def test_key_map_renames_and_drops(tmp_path):
    ckptlib.save(str(tmp_path / "c"), {"model": {"a.w": torch.ones(2), "b.w": torch.zeros(3), "drop": torch.ones(1)}})
    out = str(tmp_path / "o")
    result = ckptlib.export(
        str(tmp_path / "c"), out, model_only=True, key_map=lambda k: None if k == "drop" else "model.layers." + k
    )
    assert sorted(read_export(out, "safetensors")) == ["model.layers.a.w", "model.layers.b.w"]
    assert "model.drop" in result.skipped
    ckptlib.export(str(tmp_path / "c"), str(tmp_path / "o3"), model_only=True, key_map={"a.": "enc.", "": "x."})
    assert sorted(read_export(str(tmp_path / "o3"), "safetensors")) == ["enc.w", "x.b.w", "x.drop"]
    with pytest.raises(StateError, match="two tensors are exported as 'same'"):
        ckptlib.export(str(tmp_path / "c"), str(tmp_path / "o2"), model_only=True, key_map=lambda k: "same")


def test_overwrite_only_with_force_and_only_an_export(tmp_path):
    ckptlib.save(str(tmp_path / "c"), {"model": {f"t{i}": torch.full((100,), float(i)) for i in range(4)}})
    src, out = str(tmp_path / "c"), tmp_path / "hf"
    ckptlib.export(src, str(out), model_only=True, max_shard_size=500)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) == 4
    (out / "config.json").write_text("{}")  # the user adds a config next to the weights
    with pytest.raises(CheckpointExistsError, match="already holds an export .*force"):
        ckptlib.export(src, str(out), model_only=True)
    ckptlib.export(src, str(out), model_only=True, force=True)
    # The old shards and index are gone, the user's config is kept.
    assert sorted(os.listdir(out)) == sorted(["config.json", EXPORT_RECORD, "model.safetensors"])

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"not ours")
    for force in (False, True):
        with pytest.raises(CheckpointExistsError, match="not an export ckptlib wrote"):
            ckptlib.export(src, str(foreign), force=force)
    assert (foreign / "model.safetensors").read_bytes() == b"not ours"

    for name, fmt in (("one.safetensors", "safetensors"), ("one.bin", "torch")):
        single = tmp_path / name
        ckptlib.export(src, str(single), format=fmt, model_only=True, max_shard_size=100)  # one file: never sharded
        with pytest.raises(CheckpointExistsError, match="already exists"):
            ckptlib.export(src, str(single), format=fmt, model_only=True)
        ckptlib.export(src, str(single), format=fmt, model_only=True, force=True, dtype="bfloat16")
        other = tmp_path / f"other-{name}"
        other.write_bytes(b"x" * 64)
        with pytest.raises(CheckpointExistsError, match="not an export ckptlib wrote"):
            ckptlib.export(src, str(other), format=fmt, model_only=True, force=True)
        assert other.read_bytes() == b"x" * 64
    assert st.load_file(str(tmp_path / "one.safetensors"))["t1"].dtype == torch.bfloat16
    assert torch.load(str(tmp_path / "one.bin"), weights_only=True)["t3"].dtype == torch.bfloat16


def test_export_reloads_with_ckptlib_at_another_world_size(tmp_path, dist_run):
    src = str(tmp_path / "c")
    expected = dist_run(3, save_side, src, "fsdp2", "adamw")[0]
    out = str(tmp_path / "hf")
    ckptlib.export(src, out, model_only=True, max_shard_size=2000)
    assert len(os.listdir(out)) > 3
    loaded = {k: torch.zeros_like(v) for k, v in expected["model"].items()}
    result = ckptlib.load(out, {"model": loaded})
    assert result.format == "safetensors"
    assert_same(expected["model"], loaded)


@pytest.mark.s3
def test_export_from_an_s3_manager_root(s3_root, tmp_path):
    mgr = ckptlib.CheckpointManager(s3_root)
    model = {"a": torch.randn(16, 4), "b": torch.arange(9)}
    mgr.save(4, {"model": model, "epoch": 2})
    mgr.save(8, {"model": {k: v + 1 for k, v in model.items()}, "epoch": 3})
    out = str(tmp_path / "hf")
    result = ckptlib.export(s3_root, out, model_only=True, step=4)
    assert result.step == 4 and result.src == f"{s3_root}/step_0000000004"
    assert_same(model, read_export(out, "safetensors"))
    latest = ckptlib.export(s3_root, str(tmp_path / "latest"), model_only=True, format="torch")
    assert latest.step == 8
    assert_same({k: v + 1 for k, v in model.items()}, read_export(str(tmp_path / "latest"), "torch"))


def test_export_logs_one_info_line(tmp_path, caplog):
    ckptlib.save(str(tmp_path / "c"), {"model": {"w": torch.ones(256)}}, step=7)
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        result = ckptlib.export(str(tmp_path / "c"), str(tmp_path / "o"), model_only=True)
    records = [r for r in caplog.records if r.name == "ckptlib" and r.ckptlib["op"] == "export"]
    assert len(records) == 1
    fields = records[0].ckptlib
    assert (fields["step"], fields["bytes"], fields["world_size"]) == (7, 1024, 1)
    assert fields["seconds"] > 0 and fields["mib_per_s"] == pytest.approx(1024 / 2**20 / fields["seconds"])
    message = records[0].getMessage()
    for part in ("step=7", "bytes=1024", "world_size=1", "MiB/s=", "seconds="):
        assert part in message
    assert result.bytes == 1024


@pytest.mark.parametrize(
    "text,expected",
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 * 2**30),
        ("1.5KB", 1500),
        ("1000", 1000),
        (4096, 4096),
        ("5G", 5 * 10**9),
        ("10mb", 10**7),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["5 gigs", "-1", "0", "GB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cli_export(tmp_path, capsys):
    ckptlib.save(str(tmp_path / "c"), {"model": {"w": torch.ones(8)}, "epoch": 1}, step=3)
    assert cli_main(["export", str(tmp_path / "c"), str(tmp_path / "o"), "--model-only", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "1 tensors" in out and "safetensors, bfloat16" in out
    assert st.load_file(str(tmp_path / "o" / "model.safetensors"))["w"].dtype == torch.bfloat16
    assert cli_main(["export", str(tmp_path / "c"), str(tmp_path / "o")]) == 1
    assert "already holds an export" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path / "c"), str(tmp_path / "o"), "--force", "--format", "torch"]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == [EXPORT_RECORD, "pytorch_model.bin"]
    assert cli_main(["export", str(tmp_path / "c"), str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2
    assert cli_main(["export", str(tmp_path / "c"), str(tmp_path / "x"), "--dtype", "int8"]) == 2
    assert cli_main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


# --------------------------------------------------------------------------- memory

TENSOR_MIB = 32
TENSORS = 12  # 384 MiB: more than one tensor + 300 MiB, so a materialising export would fail

_MEASURE = textwrap.dedent(
    """
    import resource, sys
    import ckptlib, ckptlib.offline.export, ckptlib.format.streaming, safetensors  # imports before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ckptlib.export(
        sys.argv[1], sys.argv[2], format=sys.argv[3], dtype=sys.argv[4] or None, max_shard_size="100MB", model_only=True
    )
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)  # ru_maxrss is in KiB on Linux
    """
)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("big") / "ckpt")
    n = TENSOR_MIB * 2**20 // 4
    ckptlib.save(path, {"model": {f"layers.{i}.weight": torch.full((n,), float(i)) for i in range(TENSORS)}}, step=1)
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units differ off Linux")
@pytest.mark.parametrize("fmt,dtype", [("safetensors", ""), ("torch", "bfloat16")])
def test_peak_memory_is_one_tensor_plus_300_mib(tmp_path, big_checkpoint, fmt, dtype):
    out = str(tmp_path / "o")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, big_checkpoint, out, fmt, dtype], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.strip().splitlines()[-1])
    largest = TENSOR_MIB * 2**20
    checkpoint_bytes = TENSORS * largest
    limit = largest + 300 * 2**20
    assert checkpoint_bytes > limit  # materialising the checkpoint could not pass
    assert growth <= limit, f"peak RSS grew {growth / 2**20:.0f} MiB (limit {limit / 2**20:.0f} MiB)"
    got = read_export(out, fmt)
    assert len(got) == TENSORS and got["layers.11.weight"][0].item() == 11.0
