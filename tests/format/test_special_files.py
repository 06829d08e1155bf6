"""A FIFO, a device or a directory in place of a checkpoint file never hangs a command or
reads without bound: only regular files (or symlinks to them) are read.

Before: a FIFO in place of `.metadata`, `ckptlib.json`, a shard or the `latest` pointer made
load, verify, inspect, ls and CheckpointManager.latest() block forever in open(), and
/dev/zero made them read until MemoryError. Every case runs under a timeout, so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import ckptlib
from ckptlib import CheckpointError, CheckpointManager, NotARegularFileError, cli
from ckptlib.format import verify
from ckptlib.format.native.root import step_dir

ROLES = [".metadata", "ckptlib.json", "__0_0.distcp", "latest", "ckptlib.lock"]
KINDS = ["fifo", "dev-zero", "directory"]
COMMANDS = ["load", "verify", "cli-verify", "cli-inspect", "cli-ls", "manager-latest", "manager-load"]


def _replace(path: str, kind: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    else:
        os.mkdir(path)


def _root(tmp_path, role: str, kind: str) -> tuple[str, str]:
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.arange(8.0)})
    target = os.path.join(root, step_dir(1))
    _replace(os.path.join(root if role in ("latest", "ckptlib.lock") else target, role), kind)
    return root, target


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out + err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("role", ROLES)
def test_special_file_never_hangs(tmp_path, capsys, role, kind, command):
    root, target = _root(tmp_path, role, kind)
    state = {"w": torch.zeros(8)}
    in_step = role not in ("latest", "ckptlib.lock")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a stale-pointer warning is fine; a hang or a raw error is not
        if command == "load":
            if in_step:
                with pytest.raises(CheckpointError) as info:
                    ckptlib.load(target, state)
                assert target in str(info.value)
            else:
                ckptlib.load(target, state)
                assert torch.equal(state["w"], torch.arange(8.0))
        elif command == "verify":
            problems = verify(target)
            errors = [p for p in problems if p.is_error]
            if in_step:
                assert errors and any(role == p.file or role in p.message for p in errors), problems
            else:
                assert errors == []
        elif command == "cli-verify":
            rc, text = _cli(capsys, "verify", target)
            assert rc == (1 if in_step else 0), text
            if in_step:
                assert role in text
        elif command == "cli-inspect":
            rc, text = _cli(capsys, "inspect", target)
            # inspect reads the manifest and .metadata only, never a shard
            assert rc == (0 if role in ("__0_0.distcp", "latest", "ckptlib.lock") else 1), text
        elif command == "cli-ls":
            rc, text = _cli(capsys, "ls", root)
            if role == "latest" and kind != "dev-zero":
                assert rc == 1 and os.path.join(root, "latest") in text, text
            else:
                assert rc == 0, text
        elif command in ("manager-latest", "manager-load"):
            mgr = CheckpointManager(root)
            try:
                got = mgr.latest() if command == "manager-latest" else mgr.load(state)
            except CheckpointError as exc:
                assert role in ("latest", ".metadata", "ckptlib.json", "__0_0.distcp"), exc
                assert exc.path is not None and (role in exc.path or role in str(exc))
            else:
                assert got in (1, None)
                if command == "manager-load" and got == 1:
                    assert torch.equal(state["w"], torch.arange(8.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_read_refuses_special_files_by_type(tmp_path, kind):
    from ckptlib.storage import LocalStorage

    store = LocalStorage(str(tmp_path))
    _replace(str(tmp_path / "x"), kind)
    with pytest.raises(NotARegularFileError) as info:
        store.read("x")
    assert info.value.path == str(tmp_path / "x")
    assert {"fifo": "FIFO", "dev-zero": "character device", "directory": "directory"}[kind] in str(info.value)
    with pytest.raises(NotARegularFileError):
        store.read("x", 0, 10)


@pytest.mark.timeout(60)
def test_plain_dcp_metadata_fifo(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "d"))
    _replace(str(tmp_path / "d" / "__0_0.distcp"), "fifo")
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        ckptlib.load(tmp_path / "d", {"w": torch.zeros(4)})
    shutil.rmtree(tmp_path / "d")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_checkpoint_path_itself_special(tmp_path, capsys, kind):
    from ckptlib import NotACheckpointError

    path = str(tmp_path / "ckpt")
    _replace(path, kind)
    with pytest.raises(NotACheckpointError, match="FIFO|character device"):
        ckptlib.load(path, {"w": torch.zeros(2)})
    with pytest.raises(NotACheckpointError):
        verify(path)
    rc, text = _cli(capsys, "verify", path)
    assert rc != 0 and path in text
