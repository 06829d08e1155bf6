"""An export that publishes as is (issue 28.2): side files kept and copied in, tied weights
written once, `--key-map`/`--prefix` on the command line, transformers' index, no absolute
path in the record, and `ckpt inspect`/`ckpt verify` on safetensors (transformers itself
reads these exports in tests/clients/test_transformers.py)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.errors import CheckpointExistsError, StateError
from ckptlib.offline.export import EXPORT_RECORD

st = pytest.importorskip("safetensors.torch")

EMBED = torch.arange(32, dtype=torch.float32).reshape(8, 4)
LLAMA = {
    "model.embed_tokens.weight": EMBED,
    "model.norm.weight": torch.ones(4),
    "lm_head.weight": EMBED.clone(),
}


def _save(tmp_path, model=None) -> str:
    src = str(tmp_path / "ckpt")
    ckptlib.save(src, {"model": dict(model or LLAMA), "step": 3}, step=3)
    return src


def _weights(directory) -> dict[str, torch.Tensor]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return st.load_file(os.path.join(directory, "model.safetensors"))
    out = {}
    for name in sorted(set(json.load(open(index))["weight_map"].values())):
        out.update(st.load_file(os.path.join(directory, name)))
    return out


def test_side_files_already_in_the_target_are_kept(tmp_path):
    src, out = _save(tmp_path), tmp_path / "hf"
    out.mkdir()
    side = {"config.json": '{"model_type": "llama"}', "tokenizer.json": "{}", "README.md": "# tiny", "adapter.bin": "x"}
    for name, text in side.items():
        (out / name).write_text(text)
    result = ckptlib.export(src, str(out), model_only=True)  # the natural order: config first, then weights
    assert sorted(os.listdir(out)) == sorted([*side, "model.safetensors", EXPORT_RECORD])
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert record["files"] == result.files == ["model.safetensors"]  # only what ckptlib wrote
    ckptlib.export(src, str(out), model_only=True, force=True, max_shard_size=40)
    assert sorted(os.listdir(out)) == sorted(
        [*side, EXPORT_RECORD, "model.safetensors.index.json"]
        + [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    )
    assert all((out / name).read_text() == text for name, text in side.items())


def test_a_target_with_weights_ckptlib_did_not_write_is_refused(tmp_path):
    src = _save(tmp_path)
    for i, name in enumerate(("model.safetensors", "pytorch_model-00001-of-00002.bin", ".metadata")):
        out = tmp_path / f"out{i}"
        out.mkdir()
        (out / name).write_bytes(b"theirs")
        (out / "config.json").write_text("{}")
        for force in (False, True):
            with pytest.raises(
                CheckpointExistsError, match=rf"not an export ckptlib wrote \(no {EXPORT_RECORD}; it holds"
            ):
                ckptlib.export(src, str(out), model_only=True, force=force)
        assert sorted(os.listdir(out)) == sorted([name, "config.json"]) and (out / name).read_bytes() == b"theirs"


def test_hf_config_and_copy_from_copy_side_files_in(tmp_path):
    src, out = _save(tmp_path), tmp_path / "hf"
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tok"
    model_dir.mkdir(), tokenizer_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "llama", "dtype": "float32", "torch_dtype": "float32"})
    )
    (model_dir / "generation_config.json").write_text('{"bos_token_id": 1}')
    (model_dir / "model.safetensors").write_bytes(b"not copied")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "README.md"):
        (tokenizer_dir / name).write_text(name)
    (tokenizer_dir / "pytorch_model.bin").write_bytes(b"not copied")
    result = ckptlib.export(
        src, str(out), model_only=True, hf_config=str(model_dir), copy_from=str(tokenizer_dir), dtype="bfloat16"
    )
    copied = [
        "README.md",
        "config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(os.listdir(out)) == sorted([*copied, "model.safetensors", EXPORT_RECORD])
    assert sorted(result.files) == sorted(
        [*copied, "model.safetensors"]
    )  # the record lists the copies: ckptlib wrote them
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "llama", "dtype": "bfloat16", "torch_dtype": "bfloat16"}  # names the weights' dtype
    assert (out / "README.md").read_text() == "README.md"
    (out / "notes.txt").write_text("mine")
    ckptlib.export(src, str(out), model_only=True, force=True)  # replaces only what the record lists
    assert sorted(os.listdir(out)) == ["ckptlib_export.json", "model.safetensors", "notes.txt"]
    (out / "config.json").write_text('{"model_type": "other"}')
    with pytest.raises(
        CheckpointExistsError, match="config.json exists with other contents than the config.json to copy"
    ):
        ckptlib.export(src, str(out), model_only=True, force=True, hf_config={"model_type": "llama"})
    assert (out / "config.json").read_text() == '{"model_type": "other"}'
    single = tmp_path / "one.safetensors"
    with pytest.raises(StateError, match="one weights file; hf_config and copy_from need a directory"):
        ckptlib.export(src, str(single), model_only=True, hf_config={"model_type": "llama"})


@pytest.mark.parametrize("how", ["config-dict", "config-in-target", "cli"])
def test_tied_weights_are_written_once_as_transformers_does(tmp_path, how):
    src, out = _save(tmp_path), tmp_path / "hf"
    config = {"model_type": "llama", "tie_word_embeddings": True}
    if how == "config-dict":
        result = ckptlib.export(src, str(out), model_only=True, hf_config=config, max_shard_size=100)
        tied = result.tied
    elif how == "config-in-target":
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config))
        tied = ckptlib.export(src, str(out), model_only=True, max_shard_size=100).tied
    else:
        (tmp_path / "config.json").write_text(json.dumps(config))
        argv = ["export", src, str(out), "--model-only", "--hf-config", str(tmp_path / "config.json")]
        assert cli_main(argv + ["--max-shard-size", "100", "--no-progress"]) == 0
        tied = json.loads((out / EXPORT_RECORD).read_text())["tied"]
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    got = _weights(out)
    assert sorted(got) == ["model.embed_tokens.weight", "model.norm.weight"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_parameters": 32 + 4, "total_size": (32 + 4) * 4}  # as transformers counts


def test_tie_rules_untied_config_and_differing_values(tmp_path):
    src = _save(tmp_path)
    result = ckptlib.export(src, str(tmp_path / "a"), model_only=True, hf_config={"tie_word_embeddings": False})
    assert result.tied == {} and sorted(_weights(tmp_path / "a")) == sorted(LLAMA)
    assert (
        ckptlib.export(src, str(tmp_path / "b"), model_only=True).tied == {}
    )  # no config: equal values alone tie nothing
    other = _save(tmp_path / "x", {**LLAMA, "lm_head.weight": EMBED + 1})
    with pytest.raises(
        StateError, match="tie_word_embeddings: true, but lm_head.weight and model.embed_tokens.weight hold"
    ):
        ckptlib.export(other, str(tmp_path / "c"), model_only=True, hf_config={"tie_word_embeddings": True})
    assert not (tmp_path / "c").exists()


def test_names_stored_in_the_same_bytes_are_written_once(tmp_path):
    """A checkpoint that stores an alias pair once (both names point at one item) is tied by
    storage identity, without any config."""
    src = str(tmp_path / "dcp")
    dcp.save({"model": dict(LLAMA)}, checkpoint_id=src)  # plain DCP: no manifest to keep in step
    path = os.path.join(src, ".metadata")
    metadata = FileSystemReader(src).read_metadata()
    embed = [(i, v) for i, v in metadata.storage_data.items() if i.fqn == "model.model.embed_tokens.weight"]
    for index in [i for i in metadata.storage_data if i.fqn == "model.lm_head.weight"]:
        del metadata.storage_data[index]
    for index, info in embed:
        metadata.storage_data[type(index)("model.lm_head.weight", index.offset, index.index)] = info
    with open(path, "wb") as f:
        f.write(pickle.dumps(metadata))
    result = ckptlib.export(src, str(tmp_path / "hf"), model_only=True)
    assert result.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert sorted(_weights(tmp_path / "hf")) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_key_map_and_prefix_on_the_command_line(tmp_path, capsys):
    src = str(tmp_path / "ckpt")
    ckptlib.save(src, {"net": {"enc.w": torch.ones(2), "head.w": torch.zeros(3), "rope.inv_freq": torch.ones(1)}})
    (tmp_path / "map.json").write_text(json.dumps({"enc.": "model.encoder.", "rope.": None}))
    (tmp_path / "map.txt").write_text("# one OLD=NEW a line\nhead.=lm_head.\n")
    out = tmp_path / "a"
    argv = ["export", src, str(out), "--prefix", "net", "--key-map", str(tmp_path / "map.json"), "--no-progress"]
    assert cli_main(argv + ["--key-map", str(tmp_path / "map.txt")]) == 0
    assert sorted(_weights(out)) == ["lm_head.w", "model.encoder.w"]
    assert "not exported: " in capsys.readouterr().out
    assert (
        cli_main(
            ["export", src, str(tmp_path / "b"), "--prefix", "net", "--key-map", "enc.=", "--key-map", "head.=x.h."]
        )
        == 0
    )
    assert sorted(_weights(tmp_path / "b")) == ["rope.inv_freq", "w", "x.h.w"]
    assert cli_main(["export", src, str(tmp_path / "c"), "--key-map", "enc"]) == 2
    assert "'enc' is not OLD=NEW (nor a file)" in capsys.readouterr().err
    assert cli_main(["export", src, str(tmp_path / "d"), "--prefix", "nope"]) == 1
    assert "no tensors to export under 'nope'" in capsys.readouterr().err


def test_the_record_names_no_absolute_path(tmp_path):
    src = _save(tmp_path)
    ckptlib.export(src, str(tmp_path / "hf"), model_only=True, hf_config={"model_type": "llama"})
    text = (tmp_path / "hf" / EXPORT_RECORD).read_text()
    record = json.loads(text)
    assert str(tmp_path) not in text and record["source"] == "ckpt" and record["step"] == 3
    assert record["total_parameters"] == 32 + 4 + 32 and record["complete"] is True


# --------------------------------------------------------------------------- inspect and verify


def test_inspect_and_verify_read_safetensors_exports_and_files(tmp_path, capsys):
    src, out = _save(tmp_path), tmp_path / "hf"
    ckptlib.export(src, str(out), model_only=True, max_shard_size=100, hf_config={"model_type": "llama"})
    assert cli_main(["verify", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{out}: OK"]
    assert cli_main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "safetensors" and summary["step"] == 3 and summary["world_size"] is None
    assert [(t["key"], t["shape"], t["dtype"]) for t in summary["tensors"]] == [
        ("lm_head.weight", [8, 4], "float32"),
        ("model.embed_tokens.weight", [8, 4], "float32"),
        ("model.norm.weight", [4], "float32"),
    ]
    single = tmp_path / "one.safetensors"
    st.save_file({"w": torch.ones(3)}, str(single))  # the safetensors library's own file
    assert cli_main(["verify", str(single)]) == 0 and cli_main(["inspect", str(single)]) == 0
    assert "w  " in capsys.readouterr().out


def _damage(directory, how: str) -> list[str]:
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    if how == "missing-shard":
        os.unlink(directory / shards[0])
        return [
            f"{directory}/{shards[0]}: is missing: model.safetensors.index.json maps 1 tensors to it",
            f"{directory}/{shards[0]}: is missing: {EXPORT_RECORD} lists it",
        ]
    if how == "no-metadata":
        del index["metadata"]
        index_path.write_text(json.dumps(index))
        return [
            f"{directory}/model.safetensors.index.json: has no metadata object "
            "(transformers' from_pretrained fails on it)"
        ]
    if how == "truncated":
        path = directory / shards[1]
        path.write_bytes(path.read_bytes()[:-4])
        key = [k for k, v in index["weight_map"].items() if v == shards[1]][0]
        return [
            f"{directory}/{shards[1]}: tensor {key!r}: data_offsets end at 128, past the 124-byte data section "
            "(truncated file?)"
        ]
    record = json.loads((directory / EXPORT_RECORD).read_text())
    record["complete"] = False
    (directory / EXPORT_RECORD).write_text(json.dumps(record))
    return [f"{directory}/{EXPORT_RECORD}: says the export never finished"]


@pytest.mark.parametrize("how", ["missing-shard", "no-metadata", "truncated", "incomplete"])
def test_verify_names_damage_in_a_sharded_export(tmp_path, capsys, how):
    src, out = _save(tmp_path), tmp_path / "hf"
    ckptlib.export(src, str(out), model_only=True, max_shard_size=100)
    lines = _damage(out, how)
    assert cli_main(["verify", str(out), "--no-progress"]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed[:-1]) == sorted(lines)
    assert printed[-1] == f"{out}: DAMAGED, {len(lines)} problem{'s' if len(lines) > 1 else ''}"


def test_a_tied_module_saved_by_ckptlib_exports_its_head_once(tmp_path):
    """ckptlib stores an alias pair once (both names on the same bytes): the export sees the
    tie by storage identity, no config needed."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight

    module = Tiny()
    ckptlib.save(str(tmp_path / "ckpt"), {"model": module})
    result = ckptlib.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), model_only=True)
    assert result.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    got = _weights(tmp_path / "hf")
    assert sorted(got) == ["model.embed_tokens.weight"]
    assert torch.equal(got["model.embed_tokens.weight"], module.model.embed_tokens.weight.detach())
