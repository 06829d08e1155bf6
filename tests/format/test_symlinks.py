"""Symlinked checkpoint files (the Hugging Face cache layout: each file a symlink into a blob
store) are read like regular files.

Before: LocalStorage.list sized files with lstat (the length of the link's target path), so
every symlinked file "had the wrong size" and the checkpoint was reported corrupt, while
plain dcp.load read it fine. The policy: a file whose *name* is inside the checkpoint
directory may be a symlink to a regular file anywhere (HF's cache needs that); names with
'..' or absolute names in the manifest or .metadata are still refused, and a symlink to a
FIFO or device is refused like the FIFO itself.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlib
from ckptlib import cli
from ckptlib.format import verify


def _hf_cache_layout(src: str, cache: str, revision: str = "0123456789abcdef") -> str:
    """Move every file of `src` into `cache/blobs/<sha256>` and return
    `cache/snapshots/<revision>`, where each file is a relative symlink to its blob (as
    huggingface_hub lays out its cache)."""
    blobs = os.path.join(cache, "blobs")
    snap = os.path.join(cache, "snapshots", revision)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for name in sorted(os.listdir(src)):
        data = open(os.path.join(src, name), "rb").read()
        blob = os.path.join(blobs, hashlib.sha256(data).hexdigest())
        os.replace(os.path.join(src, name), blob)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
    os.rmdir(src)
    with open(os.path.join(cache, "refs_main"), "w") as f:
        f.write(revision)
    return snap


def _state(v: float = 1.5) -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4) * v, "b": torch.full((4,), v)}, "step": 7}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "step": 0}


def _assert_loaded(state: dict, v: float = 1.5) -> None:
    assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4) * v)
    assert torch.equal(state["model"]["b"], torch.full((4,), v))


def _all_links(snap: str) -> None:
    names = os.listdir(snap)
    assert names and all(os.path.islink(os.path.join(snap, n)) for n in names)


def test_ckptlib_checkpoint_in_hf_cache_layout(tmp_path, capsys):
    src = str(tmp_path / "ckpt")
    ckptlib.save(src, _state())
    snap = _hf_cache_layout(src, str(tmp_path / "cache"))
    _all_links(snap)
    assert [p for p in verify(snap) if p.is_error] == []
    state = _zeros()
    result = ckptlib.load(snap, state)
    _assert_loaded(state)
    assert state["step"] == 7 and result.format == "ckptlib"
    assert cli.main(["verify", snap]) == 0
    assert cli.main(["inspect", snap]) == 0
    capsys.readouterr()
    # a damaged blob is still caught through the link
    blob = os.path.realpath(os.path.join(snap, "__0_0.distcp"))
    data = bytearray(open(blob, "rb").read())
    data[-1] ^= 0xFF
    open(blob, "wb").write(bytes(data))
    assert any(p.is_error for p in verify(snap))


def test_plain_dcp_checkpoint_in_hf_cache_layout(tmp_path):
    src = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), checkpoint_id=src)
    snap = _hf_cache_layout(src, str(tmp_path / "cache"))
    _all_links(snap)
    state = _zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=snap)  # what plain DCP does with it
    _assert_loaded(state)
    state = _zeros()
    assert ckptlib.load(snap, state).format == "dcp"
    _assert_loaded(state)
    assert [p for p in verify(snap) if p.is_error] == []


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded-index"])
def test_safetensors_in_hf_cache_layout(tmp_path, sharded):
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    w, b = torch.arange(12.0).reshape(3, 4) * 1.5, torch.full((4,), 1.5)
    (src / "config.json").write_text("{}")
    if sharded:
        save_file({"w": w}, str(src / "model-00001-of-00002.safetensors"))
        save_file({"b": b}, str(src / "model-00002-of-00002.safetensors"))
        (src / "model.safetensors.index.json").write_text(
            '{"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors", '
            '"b": "model-00002-of-00002.safetensors"}}'
        )
    else:
        save_file({"w": w, "b": b}, str(src / "model.safetensors"))
    snap = _hf_cache_layout(str(src), str(tmp_path / "cache"))
    _all_links(snap)
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}
    result = ckptlib.load(snap, state)
    assert result.format == "safetensors"
    assert torch.equal(state["model"]["w"], w) and torch.equal(state["model"]["b"], b)
    out = ckptlib.convert(snap, tmp_path / "converted", progress=False)
    assert out.tensors == 2


def test_manager_root_with_symlinked_step_files(tmp_path):
    from ckptlib import CheckpointManager
    from ckptlib.format.native.root import step_dir

    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, _state(1.0))
    step1 = str(root / step_dir(1))
    tmp_snap = _hf_cache_layout(step1, str(tmp_path / "cache"))
    os.makedirs(step1)
    for name in os.listdir(tmp_snap):
        os.symlink(os.path.realpath(os.path.join(tmp_snap, name)), os.path.join(step1, name))
    assert mgr.steps() == [1] and mgr.latest() == 1
    state = _zeros()
    assert mgr.load(state) == 1
    _assert_loaded(state, 1.0)
    blobs = sorted(os.listdir(tmp_path / "cache" / "blobs"))
    mgr.save(2, _state(2.0))  # retention removes step 1: its links, never the blobs they point to
    assert not os.path.exists(step1)
    assert sorted(os.listdir(tmp_path / "cache" / "blobs")) == blobs


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "a/../../b"])
def test_names_that_escape_are_still_refused(tmp_path, name):
    import json
    import zlib

    from ckptlib import UnsafeCheckpointError

    d = tmp_path / "ckpt"
    ckptlib.save(d, _state())
    doc = json.loads((d / "ckptlib.json").read_text())
    doc["files"][name] = {"size": 0, "crc32": 0, "items": []}
    doc.pop("checksum")
    doc["checksum"] = zlib.crc32(json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())
    (d / "ckptlib.json").write_text(json.dumps(doc))
    with pytest.raises(UnsafeCheckpointError, match="escapes"):
        ckptlib.load(d, _zeros())
