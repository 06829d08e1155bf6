"""Destructive operations touch only what ckptlib wrote.

Before: `overwrite=True` and `ckpt convert --force` removed whatever directory they were
pointed at (a CheckpointManager root, a user directory with unrelated files), and retention
and gc removed step directories with `rmtree`, whatever else was in them.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlib
from ckptlib import CheckpointExistsError, CheckpointManager, NotACheckpointError, OverwriteRefusedError, cli
from ckptlib.format.native.root import step_dir
from ckptlib.manager.cleanup import ForeignFilesWarning
from ckptlib.testing.fakes.s3_server import s3_client, s3_env


def _tree(root) -> dict[str, bytes]:
    """Every file under `root` (symlinks as 'link -> target'), with its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            out[rel] = f"link -> {os.readlink(full)}".encode() if os.path.islink(full) else open(full, "rb").read()
    return out


def _state(v: float = 1.0) -> dict:
    return {"w": torch.full((4,), v), "n": int(v)}


def _manager_root(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, _state(step))
    return root


def _user_dir(tmp_path):
    d = tmp_path / "home"
    (d / "sub").mkdir(parents=True)
    (d / "thesis.tex").write_text("years of work")
    (d / "sub" / "data.csv").write_text("1,2,3")
    return d


def _ckpt_with_extra_file(tmp_path):
    d = tmp_path / "ckpt"
    ckptlib.save(d, _state())
    (d / "NOTES.md").write_text("what this run was")
    return d


def _ckpt_with_subdir(tmp_path):
    d = tmp_path / "ckpt"
    ckptlib.save(d, _state())
    (d / "eval").mkdir()
    (d / "eval" / "scores.json").write_text("{}")
    return d


def _debris_with_extra_file(tmp_path):
    d = tmp_path / "debris"
    d.mkdir()
    (d / "ckptlib.pending").write_text("{}")
    (d / "__0_0.distcp").write_bytes(b"half")
    (d / "keep.txt").write_text("mine")
    return d


TARGETS = {
    "manager-root": _manager_root,
    "user-dir": _user_dir,
    "ckpt+user-file": _ckpt_with_extra_file,
    "ckpt+subdir": _ckpt_with_subdir,
    "debris+user-file": _debris_with_extra_file,
}


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "no-overwrite"])
@pytest.mark.parametrize("target", list(TARGETS))
def test_save_refuses_targets_that_are_not_only_a_checkpoint(tmp_path, target, overwrite):
    path = TARGETS[target](tmp_path)
    before = _tree(path)
    with pytest.raises(CheckpointExistsError) as info:
        ckptlib.save(path, _state(9), overwrite=overwrite)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)
    if overwrite or target == "debris+user-file":
        assert isinstance(info.value, OverwriteRefusedError) and isinstance(info.value, NotACheckpointError)
        assert "nothing was touched" in str(info.value)
    if target == "manager-root":
        assert "CheckpointManager root" in str(info.value)
    assert _tree(path) == before


def test_overwrite_replaces_a_ckptlib_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    ckptlib.save(d, _state(1))
    ckptlib.save(d, _state(2), overwrite=True)
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp", "ckptlib.json"]
    state = _state(0)
    ckptlib.load(d, state)
    assert torch.equal(state["w"], torch.full((4,), 2.0)) and state["n"] == 2


def test_overwrite_replaces_a_plain_dcp_checkpoint(tmp_path):
    d = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(1), checkpoint_id=str(d))
    with pytest.raises(CheckpointExistsError):
        ckptlib.save(d, _state(2))
    ckptlib.save(d, _state(2), overwrite=True)
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp", "ckptlib.json"]
    assert ckptlib.load(d, _state(0)).format == "ckptlib"


def test_debris_of_a_crashed_save_is_replaced_without_overwrite(tmp_path):
    d = tmp_path / "debris"
    d.mkdir()
    (d / "ckptlib.pending").write_text("{}")
    (d / "__0_0.distcp").write_bytes(b"half")
    (d / "__1_0.distcp.tmp-0123abcd").write_bytes(b"tmp")
    ckptlib.save(d, _state(3))
    assert sorted(os.listdir(d)) == [".metadata", "__0_0.distcp", "ckptlib.json"]


# --------------------------------------------------------------------------- convert --force


def _torch_file(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"model": {"w": torch.zeros(4)}}, path)
    return path


@pytest.mark.parametrize("target", list(TARGETS))
def test_convert_force_to_dcp_refuses_what_is_not_a_checkpoint(tmp_path, capsys, target):
    src = _torch_file(tmp_path)
    path = TARGETS[target](tmp_path)
    before = _tree(path)
    with pytest.raises(OverwriteRefusedError):
        ckptlib.convert(src, path, force=True, progress=False)
    assert _tree(path) == before
    rc = cli.main(["convert", str(src), str(path), "--force", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc != 0 and str(path) in err and "Traceback" not in err
    assert _tree(path) == before


def test_convert_force_replaces_a_checkpoint(tmp_path):
    src = _torch_file(tmp_path)
    dst = tmp_path / "ckpt"
    ckptlib.save(dst, {"model": {"w": torch.ones(4)}})
    ckptlib.convert(src, dst, force=True, progress=False)
    state = {"model": {"w": torch.ones(4)}}
    ckptlib.load(dst, state)
    assert torch.equal(state["model"]["w"], torch.zeros(4))


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_convert_force_refuses_to_overwrite_a_file_ckptlib_did_not_write(tmp_path, to):
    src = _torch_file(tmp_path)
    victim = tmp_path / ("essay.safetensors" if to == "safetensors" else "essay.pt")
    victim.write_text("not a checkpoint, a user's file")
    with pytest.raises(OverwriteRefusedError, match="not an export ckptlib wrote; refusing to overwrite it even with"):
        ckptlib.convert(src, victim, to=to, force=True, progress=False)
    assert victim.read_text() == "not a checkpoint, a user's file"
    plain = tmp_path / "notes"
    plain.write_text("mine")
    with pytest.raises(OverwriteRefusedError):
        ckptlib.convert(src, plain, to=to, force=True, progress=False)
    assert plain.read_text() == "mine"


def test_convert_force_replaces_only_a_torch_file_ckptlib_wrote(tmp_path):
    """One force rule for convert and export: a torch.save file someone else wrote (even a
    checkpoint) is refused; one that convert wrote (it carries ckptlib's mark) is replaced."""
    src = tmp_path / "src"
    ckptlib.save(src, {"model": {"w": torch.full((4,), 5.0)}})
    theirs = _torch_file(tmp_path)
    before = theirs.read_bytes()
    with pytest.raises(OverwriteRefusedError, match="not an export ckptlib wrote"):
        ckptlib.convert(src, theirs, to="torch", force=True, progress=False)
    assert theirs.read_bytes() == before
    ours = tmp_path / "ours.pt"
    ckptlib.convert(_torch_file(tmp_path), ours, to="torch", progress=False)
    with pytest.raises(CheckpointExistsError, match="already exists .*force"):
        ckptlib.convert(src, ours, to="torch", progress=False)
    ckptlib.convert(src, ours, to="torch", force=True, progress=False)
    assert torch.equal(torch.load(ours)["model"]["w"], torch.full((4,), 5.0))


def test_convert_force_to_a_safetensors_directory_keeps_other_files(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    ckptlib.save(src, {"model": {"w": torch.full((4,), 5.0)}})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"hidden": 4}')
    save_file({"old": torch.zeros(2)}, str(hf / "model.safetensors"))
    before = _tree(hf)
    with pytest.raises(OverwriteRefusedError, match="not an export ckptlib wrote"):  # not ours: untouched
        ckptlib.convert(src, hf, to="safetensors", force=True, progress=False)
    assert _tree(hf) == before

    out = tmp_path / "out"
    ckptlib.convert(_torch_file(tmp_path), out, to="safetensors", progress=False)
    (out / "config.json").write_text('{"hidden": 4}')  # the user adds a config next to the weights
    (out / "adapter.bin").write_bytes(b"\x00" * 8)
    ckptlib.convert(src, out, to="safetensors", force=True, progress=False)
    assert sorted(os.listdir(out)) == ["adapter.bin", "ckptlib_export.json", "config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == '{"hidden": 4}'
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.full((4,), 5.0))


# --------------------------------------------------------------------------- retention, gc, debris


def test_retention_leaves_a_users_file_in_a_step_directory(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, _state(1))
    (root / step_dir(1) / "eval.txt").write_text("loss 0.1")
    with pytest.warns(ForeignFilesWarning, match="eval.txt"):
        mgr.save(2, _state(2))
    assert sorted(os.listdir(root / step_dir(1))) == ["eval.txt"]
    assert (root / step_dir(1) / "eval.txt").read_text() == "loss 0.1"
    assert mgr.steps() == [2] and mgr.latest() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the foreign directory is neither debris nor warned about again
        mgr.save(3, _state(3))
        assert mgr.gc() == [] and mgr.steps() == [3]
    assert cli.main(["ls", "--json", str(root)]) == 0
    import json

    rows = {r["step"]: r["state"] for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows == {1: "foreign", 3: "committed"}


def test_debris_cleanup_leaves_a_users_file(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    debris = root / step_dir(2)
    debris.mkdir()
    (debris / "ckptlib.pending").write_text("{}")
    (debris / "__0_0.distcp").write_bytes(b"half")
    (debris / "mine.txt").write_text("mine")
    with pytest.warns(ForeignFilesWarning):
        mgr.gc()
    assert sorted(os.listdir(debris)) == ["mine.txt"]
    assert mgr.steps() == [1]


def test_a_plain_dcp_checkpoint_in_a_step_directory_is_never_deleted(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(7), checkpoint_id=str(root / step_dir(7)))
    before = _tree(root / step_dir(7))
    mgr.save(8, _state(8))
    mgr.save(9, _state(9))
    assert _tree(root / step_dir(7)) == before
    assert mgr.steps() == [9]


def test_interrupted_deletion_leftover_keeps_foreign_files(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, _state(1))
    left = root / "step_0000000005.deleting-0123abcd"
    left.mkdir()
    (left / ".metadata").write_bytes(b"x")
    (left / "__0_0.distcp").write_bytes(b"x")
    (left / "user.txt").write_text("mine")
    empty_left = root / "step_0000000006.deleting-89abcdef"
    empty_left.mkdir()
    (empty_left / "__0_0.distcp").write_bytes(b"x")
    with pytest.warns(ForeignFilesWarning):
        mgr.gc()
    assert sorted(os.listdir(left)) == ["user.txt"]
    assert not empty_left.exists()


@pytest.mark.s3
def test_s3_retention_deletes_only_ckptlib_objects(moto_server, s3_root, monkeypatch):
    for key, value in s3_env(moto_server).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    bucket = s3_root.split("/")[2]
    client = s3_client(moto_server)
    mgr = CheckpointManager(s3_root, keep_last=1)
    mgr.save(1, _state(1))
    client.put_object(Bucket=bucket, Key=f"run/{step_dir(1)}/eval/scores.json", Body=b"{}")
    with pytest.warns(ForeignFilesWarning, match="scores.json"):
        mgr.save(2, _state(2))
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert {k for k in keys if step_dir(1) in k} == {f"run/{step_dir(1)}/eval/scores.json"}
    assert mgr.steps() == [2]
    with pytest.raises(OverwriteRefusedError):
        ckptlib.save(s3_root, _state(3), overwrite=True)  # the manager root itself
    assert mgr.latest() == 2
