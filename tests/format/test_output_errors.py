"""convert and export fail with a named CheckpointError naming the file, remove what they
wrote, and never print a traceback, whatever the destination is or becomes:

- a destination below a file (or a FIFO) instead of a directory, or a FIFO or device in the
  destination's place: CheckpointExistsError (OverwriteRefusedError with force), before
  anything is written;
- a full disk during `ckpt convert --to dcp|torch|safetensors` or `ckpt export` (one file or
  shards, torch or safetensors): StorageError "cannot write <file>: no space left on device",
  no partial shard or temporary file left, and the same command succeeds once there is room.

Before: NotADirectoryError / FileExistsError from os; on a full disk a raw OSError
("[Errno 28]"), torch's RuntimeError ("basic_ios::clear: iostream error"), and for a torch
export the process aborted (std::terminate from torch's zip writer destructor).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.tmpfs import small_tmpfs

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.errors import CheckpointError, CheckpointExistsError, OverwriteRefusedError, StorageError

pytest.importorskip("safetensors")

# (command, extra argv, the API call as (function name, kwargs)) for every writer of convert/export
WRITERS = {
    "convert-dcp": (["convert", "--to", "dcp"], ("convert", {"to": "dcp"})),
    "convert-torch": (["convert", "--to", "torch"], ("convert", {"to": "torch"})),
    "convert-safetensors": (["convert", "--to", "safetensors"], ("convert", {"to": "safetensors"})),
    "export-safetensors": (["export", "--format", "safetensors"], ("export", {"format": "safetensors"})),
    "export-torch": (["export", "--format", "torch"], ("export", {"format": "torch"})),
    "export-one-file": (["export", "--format", "safetensors"], ("export", {"format": "safetensors"})),
    "export-shards": (
        ["export", "--format", "torch", "--max-shard-size", "900000"],
        ("export", {"format": "torch", "max_shard_size": 900000}),
    ),
}


def _dst(base: str, writer: str) -> str:
    name = {"convert-torch": "out.pt", "export-one-file": "out.safetensors"}.get(writer, "out")
    return os.path.join(base, name)


def _ckpt(argv: list[str]) -> subprocess.CompletedProcess:
    """`ckpt ARGV` in a process of its own (a writer that crashes the process is caught too)."""
    return subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", *argv, "--no-progress"], capture_output=True, text=True, timeout=300
    )


def _call(writer: str, src: str, dst: str, force: bool = False):
    fn, kwargs = WRITERS[writer][1]
    return getattr(ckptlib, fn)(src, dst, force=force, **kwargs)


def _tree(path: str) -> list[str]:
    out = []
    for here, dirs, names in os.walk(path):
        out += [os.path.relpath(os.path.join(here, n), path) for n in names + dirs]
    return sorted(out)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("src") / "ckpt")
    gen = torch.Generator().manual_seed(0)
    ckptlib.save(path, {"model": {"a": torch.randn(300_000, generator=gen), "b": torch.randn(300_000, generator=gen)}})
    return path


@pytest.mark.parametrize("blocker", ["file", "fifo"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_destination_below_a_file_is_refused_by_name(tmp_path, capsys, src, writer, blocker):
    base = tmp_path / "in-the-way"
    if blocker == "file":
        base.write_bytes(b"not a directory")
    else:
        os.mkfifo(base)
    dst = _dst(str(base / "sub"), writer)
    with pytest.raises(CheckpointExistsError, match=f"cannot write {dst}: {base} is a (file|FIFO).*not a directory"):
        _call(writer, src, dst)
    capsys.readouterr()
    assert cli_main([WRITERS[writer][0][0], src, dst, *WRITERS[writer][0][1:], "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ckpt {WRITERS[writer][0][0]}: error: cannot write {dst}: ") and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["in-the-way"]


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_fifo_in_the_destinations_place_is_refused_by_name(tmp_path, src, writer, force):
    dst = _dst(str(tmp_path), writer)
    os.mkfifo(dst)
    with pytest.raises(OverwriteRefusedError if force else CheckpointExistsError, match="is a FIFO"):
        _call(writer, src, dst, force=force)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(dst)]
    assert not os.path.isfile(dst) and not os.path.isdir(dst)  # still the FIFO, never opened


@pytest.mark.parametrize("writer", ["convert-dcp", "export-safetensors"])
def test_a_device_as_the_destination_is_refused_by_name(src, writer):
    with pytest.raises(CheckpointError, match="/dev/null is a character device; refusing to write there"):
        _call(writer, src, "/dev/null", force=True)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_full_disk_is_a_storage_error_naming_the_file_and_leaves_nothing(tmp_path, src, writer):
    with small_tmpfs(str(tmp_path / "disk"), "1m") as disk:
        dst = _dst(disk, writer)
        with pytest.raises(StorageError, match="cannot write .*: no space left on device") as info:
            _call(writer, src, dst)
        assert info.value.path.startswith(dst), info.value.path
        assert _tree(disk) == []  # no partial shard, temporary file, record or directory
        done = _ckpt([WRITERS[writer][0][0], src, dst, *WRITERS[writer][0][1:]])
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and "CheckpointException" not in done.stderr, done.stderr
        assert "no space left on device" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert _tree(disk) == []
    with small_tmpfs(str(tmp_path / "roomy"), "16m") as roomy:  # the same call succeeds once there is room
        _call(writer, src, _dst(roomy, writer))
        assert _tree(roomy)
