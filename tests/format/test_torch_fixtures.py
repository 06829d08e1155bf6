"""Golden DCP checkpoints written by every torch era back to 1.13: inspect, convert, reload.

tests/format/test_legacy.py loads every fixture at world sizes 1..4 bit-exactly; this module checks
what `ckpt inspect` reports about the DCP-based ones (written by real torch 1.13.1, 2.0.1,
2.1-2.5, 2.9, 2.13 and by ckptlib itself), that `ckpt convert` turns each into a ckptlib
checkpoint and a torch.save file holding the same bits, and the unpickling fix that lets
torch 1.13's `.metadata` load at all (its classes were pickled under
`torch.distributed._shard.checkpoint.*`).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import pickletools

import pytest
import torch
from helpers.golden import (
    FIXTURE_NAMES,
    check_ranks,
    diff,
    fixture_info,
    fixture_path,
    generator,
    launch_ranks,
    rank_load_and_compare,
    reference,
)

import ckptlib
from ckptlib import cli
from ckptlib._torch import dcp_shims
from ckptlib.errors import UnsafeCheckpointError
from ckptlib.format.native.safe_pickle import safe_loads

pytestmark = pytest.mark.legacy

DCP_FIXTURES = [n for n in FIXTURE_NAMES if fixture_info(n)["format"] in ("dcp", "ckptlib")]


def _minor(name: str) -> str:
    return ".".join(fixture_info(name)["torch_version"].split("+")[0].split(".")[:2])


def _tensor_leaves(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Dotted key -> tensor for every tensor in a nested state (DCP's key for it, under the
    rules of every torch: only the keys of non-tensor values changed in 2.4)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_tensor_leaves(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def _ckpt(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def test_golden_fixtures_span_every_torch_era():
    """1.13 (torch.distributed._shard.checkpoint), 2.0 (ShardedTensor, DCP public), a
    DTensor one before and after 2.4's key-flattening change, and FSDP2 ones from the window."""
    minors = {_minor(n) for n in DCP_FIXTURES}
    assert {"1.13", "2.0", "2.9", "2.13"} <= minors, minors
    assert any(m in minors for m in ("2.1", "2.2", "2.3")), minors  # pre-2.4 flattening, DTensor
    assert any(m in minors for m in ("2.4", "2.5")), minors  # 2.4 flattening, DTensor in _tensor


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_inspect_reports_what_the_torch_saved(name, capsys):
    """`ckpt inspect --json`: format, saved world size and every tensor's key, shape, dtype and
    chunk count (one chunk per rank for row-sharded tensors, one for 0-dim ones)."""
    info = fixture_info(name)
    path = fixture_path(name)
    rc, out, err = _ckpt(capsys, "inspect", "--json", path)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["format"] == info["format"]
    assert doc["world_size"] == info["saved_world_size"]
    files = [f for f in os.listdir(path) if f != "ckptlib.json"]  # a manifest does not count itself
    assert doc["total_bytes"] == sum(os.path.getsize(os.path.join(path, f)) for f in files)
    expected = _tensor_leaves(reference(name))
    listed = {t["key"]: t for t in doc["tensors"]}
    assert set(listed) == set(expected)
    for key, tensor in expected.items():
        entry = listed[key]
        assert (tuple(entry["shape"]), entry["dtype"]) == (
            tuple(tensor.shape),
            str(tensor.dtype).removeprefix("torch."),
        ), key
        assert entry["chunks"] == (info["saved_world_size"] if tensor.dim() else 1), (key, entry)
    rc, out, err = _ckpt(capsys, "verify", path)
    assert rc == 0 and out.splitlines()[-1] == f"{path}: OK", out + err


@pytest.mark.parametrize("to", ["dcp", "torch"])
@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_ckpt_convert_keeps_every_bit(name, to, tmp_path, capsys):
    """`ckpt convert` to a ckptlib checkpoint (loaded back at 3 ranks) or a torch.save file."""
    dst = tmp_path / ("converted.pt" if to == "torch" else "converted")
    rc, out, err = _ckpt(capsys, "convert", fixture_path(name), dst, "--to", to, "--no-progress")
    assert rc == 0, err
    assert out.startswith(f"converted {fixture_path(name)} ({fixture_info(name)['format']}) -> {dst}")
    if to == "torch":
        expected = reference(name)
        if _minor(name) == "1.13":  # 1.13 saved a flat dict (no nesting recorded): it converts flat
            expected = generator()._flatten_pre_2_4(expected)
        assert diff(torch.load(dst, weights_only=True), expected) == []
        return
    rc, out, err = _ckpt(capsys, "inspect", "--json", dst)
    assert rc == 0 and json.loads(out)["format"] == "ckptlib"
    results = launch_ranks(3, rank_load_and_compare, name, str(dst))
    check_ranks(results, f"{name} converted")
    assert {r["format"] for r in results} == {"ckptlib"}


# --------------------------------------------------------------------------- torch 1.13's pickled module names


OLD_METADATA = "torch.distributed._shard.checkpoint.metadata"


def test_old_module_names_map_onto_todays():
    assert dcp_shims.current_pickle_module(OLD_METADATA) == "torch.distributed.checkpoint.metadata"
    assert dcp_shims.current_pickle_module("torch.distributed._shard.checkpoint.filesystem") == (
        "torch.distributed.checkpoint.filesystem"
    )
    assert dcp_shims.current_pickle_module("torch.distributed._shard.checkpoint.no_such_module") == (
        "torch.distributed._shard.checkpoint.no_such_module"
    )
    assert (
        dcp_shims.current_pickle_module("torch.distributed._shard.checkpointing")
        == "torch.distributed._shard.checkpointing"
    )
    assert dcp_shims.current_pickle_module("collections") == "collections"


def test_torch_113_metadata_unpickles_as_todays_classes():
    """Without the mapping, unpickling imports a second copy of metadata.py and DCP rejects its
    classes ("expected BytesStorageMetadata but found ...TensorStorageMetadata")."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    path = os.path.join(fixture_path("dcp_sharded_tensor_torch1.13"), ".metadata")
    data = open(path, "rb").read()
    named = {arg for op, arg, _ in pickletools.genops(data) if op.name in ("GLOBAL", "SHORT_BINUNICODE")}
    assert OLD_METADATA in named  # what makes this fixture a test of the mapping
    md = safe_loads(data, path)
    assert type(md) is Metadata
    kinds = {type(v) for v in md.state_dict_metadata.values()}
    assert kinds == {TensorStorageMetadata, BytesStorageMetadata}
    assert md.planner_data is None  # 1.13 recorded no key paths: keys are flat


def test_old_module_names_still_admit_only_classes(tmp_path):
    """The mapping renames modules; it does not widen what may be unpickled."""

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    plain = pickle.dumps(Evil(), protocol=0)
    crafted = plain.replace(b"posix\nsystem", b"torch.distributed._shard.checkpoint.filesystem\nos")
    assert crafted != plain
    for data in (crafted, plain):
        with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
            safe_loads(data, str(tmp_path / ".metadata"))


def test_torch_113_per_item_files_load_in_one_process():
    """1.13's writer made one .distcp file per item (dozens for this small state)."""
    path = fixture_path("dcp_sharded_tensor_torch1.13")
    assert (
        len([f for f in os.listdir(path) if f.endswith(".distcp")])
        > 2 * fixture_info("dcp_sharded_tensor_torch1.13")["saved_world_size"]
    )
    ref = reference("dcp_sharded_tensor_torch1.13")
    state = {"extra": {k: torch.zeros_like(v) for k, v in ref["extra"].items()}, "meta": {"epoch": -1, "tag": "wrong"}}
    result = ckptlib.load(path, state)
    assert result.format == "dcp" and result.world_size == 2
    assert diff(state, {"extra": ref["extra"], "meta": ref["meta"]}) == []


# --------------------------------------------------------------------------- ckpt diff over every era's keys

# Before: `ckpt diff` compared the keys as stored, so every fixture of torch 1.13 and 2.0-2.3
# (whose `meta` and `optim.param_groups` were pickled whole) was DIFFERENT from its own
# reference and from its own conversion ("only in A: meta; only in B: meta.epoch, meta.tag").

DIFF_FIXTURES = [n for n in FIXTURE_NAMES if "model" in reference(n)]


def _diff_summary(out: str) -> str:
    return next(line for line in out.splitlines() if " tensors compared: " in line)


@pytest.mark.parametrize("name", DIFF_FIXTURES)
def test_diff_against_its_reference_is_equal(name, tmp_path, capsys):
    ref = os.path.join(os.path.dirname(fixture_path(name)), "reference.pt")
    flat = dcp_shims.flatten_state_dict(reference(name))[0]
    tensors = sum(isinstance(v, torch.Tensor) for v in flat.values())
    objects = len(flat) - tensors
    for a, b in ((fixture_path(name), ref), (ref, fixture_path(name))):
        rc, out, err = _ckpt(capsys, "diff", a, b, "--no-progress")
        assert (rc, out.splitlines()[-1]) == (0, "EQUAL"), out + err
        assert _diff_summary(out) == (
            f"{tensors} tensors compared: {tensors} bit-identical, 0 equal within atol=0 rtol=0, 0 different; 0 "
            f"shape/kind mismatches; 0 keys only in A, 0 only in B; {objects} other entries, 0 different"
        )


@pytest.mark.parametrize("to", ["dcp", "torch", "safetensors"])
@pytest.mark.parametrize("name", DIFF_FIXTURES)
def test_diff_against_its_conversion_is_equal(name, to, tmp_path, capsys):
    """diff(source, convert(source)) for every target `ckpt convert` writes (safetensors holds
    the model alone: compared with --only model)."""
    dst = tmp_path / ("converted.pt" if to == "torch" else "converted")
    rc, _, err = _ckpt(capsys, "convert", fixture_path(name), dst, "--to", to, "--no-progress")
    assert rc == 0, err
    only = ["--only", "model"] if to == "safetensors" else []
    for a, b in ((fixture_path(name), dst), (dst, fixture_path(name))):
        rc, out, err = _ckpt(capsys, "diff", a, b, "--no-progress", *only)
        assert (rc, out.splitlines()[-1]) == (0, "EQUAL"), out + err
        assert "0 different; 0 shape/kind mismatches; 0 keys only in A, 0 only in B;" in out


@pytest.mark.parametrize("name", DIFF_FIXTURES)
def test_diff_names_one_changed_value(name, tmp_path, capsys):
    """One element of one model tensor, `meta.epoch` and `optim.param_groups.0.lr` (each pickled
    whole inside a bigger value by torch 1.13-2.3), changed one at a time in the reference:
    DIFFERENT, and only that key is named."""
    ref = reference(name)
    flat = dcp_shims.flatten_state_dict(ref)[0]
    tensor_key = next(k for k in sorted(flat) if k.startswith("model.") and flat[k].is_floating_point())
    changes = [tensor_key] + [k for k in ("meta.epoch", "optim.param_groups.0.lr") if k in flat]
    for key in changes:
        changed = copy.deepcopy(ref)
        path = dcp_shims.flatten_state_dict(changed)[1][key]
        if key == tensor_key:
            leaf = changed
            for part in path:
                leaf = leaf[part]
            leaf.reshape(-1)[0] += 1.0
            expected = f"differs: {key}: 1 of {leaf.numel()} elements beyond tolerance; max abs diff 1 at "
        else:
            dcp_shims.set_element(changed, path, flat[key] * 2)
            expected = f"differs: {key}: {flat[key]!r} vs {flat[key] * 2!r}"
        torch.save(changed, tmp_path / "changed.pt")
        rc, out, err = _ckpt(capsys, "diff", fixture_path(name), tmp_path / "changed.pt", "--no-progress")
        assert (rc, out.splitlines()[-1]) == (1, "DIFFERENT"), out + err
        assert [line for line in out.splitlines() if line.startswith("differs")] == [
            next(line for line in out.splitlines() if line.startswith(expected))
        ], out
        assert "shape/kind mismatches; 0 keys only in A, 0 only in B;" in out
