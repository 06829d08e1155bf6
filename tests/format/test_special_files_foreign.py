"""A FIFO, a device or a directory in the place of a foreign format's file (a v0 rank file, a
torch.save file, a safetensors shard) is refused as such, naming the file, by every reader.

Before: a sharded safetensors checkpoint whose shard was a FIFO or directory was reported as
"missing" (its size probe skipped anything not a regular file), and a v0 checkpoint with a
directory in place of a rank file said that rank's file "is not there". Every case runs under a
timeout, so a regression that opens the FIFO fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import shutil

import pytest

import ckptlib
from ckptlib import CheckpointError, NotACheckpointError, NotARegularFileError, cli

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
# (fixture source, the file within it to replace; "" when the source is itself the file)
PLACES = {
    "v0-rank0": ("v0_ws3/ckpt", "rank_0.pt"),
    "v0-rank2": ("v0_ws3/ckpt", "rank_2.pt"),
    "safetensors-single": ("safetensors_single/ckpt", "model.safetensors"),
    "safetensors-shard": ("safetensors_sharded/ckpt", "model-00002-of-00003.safetensors"),
    "torch-save": ("torch_save/checkpoint.pt", ""),
    "pytorch-model-bin": ("torch_save_model_only/pytorch_model.bin", ""),
}
KINDS = {"fifo": "FIFO", "dev-zero": "character device", "directory": "directory"}


def _replace(path: str, kind: str) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    else:
        os.mkdir(path)


def _source(tmp_path, place: str, kind: str) -> tuple[str, str]:
    """The checkpoint to open and the special file in it."""
    src, name = PLACES[place]
    if name:
        ckpt = str(tmp_path / "ckpt")
        shutil.copytree(os.path.join(FIXTURES, src), ckpt)
        special = os.path.join(ckpt, name)
    else:
        ckpt = special = str(tmp_path / os.path.basename(src))
    _replace(special, kind)
    return ckpt, special


def _expected(place: str, kind: str) -> tuple[type[CheckpointError], bool]:
    """The error, and whether it names the special file (True) or only the checkpoint."""
    if place == "safetensors-single" and kind == "directory":
        return NotACheckpointError, False  # a lone subdirectory: no checkpoint file is there at all
    if PLACES[place][1]:
        return NotARegularFileError, True
    return (NotACheckpointError if kind != "directory" else CheckpointError), True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("place", list(PLACES))
def test_convert_refuses_special_file(tmp_path, place, kind):
    ckpt, special = _source(tmp_path, place, kind)
    out = str(tmp_path / "out")
    error, names_file = _expected(place, kind)
    with pytest.raises(error) as info:
        ckptlib.convert(ckpt, out)
    if not names_file:
        assert f"{ckpt} is not a checkpoint" in str(info.value)
    else:
        assert special in str(info.value)
        if kind != "directory" or PLACES[place][1]:
            assert KINDS[kind] in str(info.value)
    assert not os.path.exists(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("place", ["v0-rank0", "v0-rank2", "safetensors-shard"])
def test_cli_convert_names_special_file(tmp_path, capsys, place, kind):
    ckpt, special = _source(tmp_path, place, kind)
    rc = cli.main(["convert", ckpt, str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out + err
    assert f"{special} is a {'FIFO (named pipe)' if kind == 'fifo' else 'directory'}, not a regular file" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_special_safetensors_index_is_refused_by_name(tmp_path, capsys, kind):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURES, "safetensors_sharded/ckpt"), ckpt)
    index = os.path.join(ckpt, "model.safetensors.index.json")
    _replace(index, kind)
    with pytest.raises(NotARegularFileError, match=KINDS[kind]) as info:
        ckptlib.convert(ckpt, str(tmp_path / "out"))
    assert info.value.path == index
    for argv in (["convert", ckpt, str(tmp_path / "out")], ["diff", ckpt, ckpt]):
        assert cli.main(argv) != 0
        err = capsys.readouterr().err
        assert f"{index} is a" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "out")
