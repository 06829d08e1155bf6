"""`export(force=True)` / `ckpt export --force` over an earlier export replaces only the files
that export's record lists: a user's file beside it that the new export would write over (their
own pytorch_model.bin next to an earlier safetensors export) is refused before anything is
touched, and a user's other files stay.

Before: the force rule removed the listed files and then wrote the new ones over whatever
else was there, so the user's pytorch_model.bin was silently replaced.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.errors import CheckpointExistsError, OverwriteRefusedError
from ckptlib.offline.export import EXPORT_RECORD

pytest.importorskip("safetensors")

USER_BYTES = b"the user's own weights, not ckptlib's"


def _snapshot(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture
def src(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    ckptlib.save(path, {"model": {"a": torch.arange(300.0), "b": torch.arange(200.0), "c": torch.ones(100)}})
    return path


# (first export format, second export format, sharded second export, the user's file that the second would write)
CASES = [
    ("safetensors", "torch", False, "pytorch_model.bin"),
    ("safetensors", "torch", True, "pytorch_model-00001-of-00003.bin"),
    ("safetensors", "torch", True, "pytorch_model.bin.index.json"),
    ("torch", "safetensors", False, "model.safetensors"),
    ("torch", "safetensors", True, "model-00002-of-00003.safetensors"),
    ("torch", "safetensors", True, "model.safetensors.index.json"),
    ("safetensors", "safetensors", True, "model-00001-of-00003.safetensors"),
]


@pytest.mark.parametrize("first,second,sharded,theirs", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("via", ["api", "cli"])
def test_force_never_replaces_a_file_the_record_does_not_list(
    tmp_path, capsys, src, first, second, sharded, theirs, via
):
    out = str(tmp_path / "hf")
    ckptlib.export(src, out, format=first, model_only=True)
    with open(os.path.join(out, theirs), "wb") as f:
        f.write(USER_BYTES)
    before = _snapshot(out)
    shard = ["--max-shard-size", "1000"] if sharded else []
    if via == "api":
        with pytest.raises(OverwriteRefusedError) as info:
            ckptlib.export(
                src, out, format=second, model_only=True, force=True, max_shard_size=1000 if sharded else "5GB"
            )
        assert theirs in str(info.value) and out in str(info.value)
    else:
        argv = ["export", src, out, "--format", second, "--model-only", "--force", "--no-progress", *shard]
        assert cli_main(argv) == 2  # an OverwriteRefusedError: the destination is not one ckptlib may replace
        err = capsys.readouterr().err
        assert err.startswith(f"ckpt export: error: {out} holds {theirs}") and "Traceback" not in err
    assert _snapshot(out) == before  # nothing touched: neither their file nor the earlier export


@pytest.mark.parametrize("second", ["safetensors", "torch"])
def test_force_keeps_the_users_other_files(tmp_path, src, second):
    out = str(tmp_path / "hf")
    ckptlib.export(src, out, format="safetensors", model_only=True)
    mine = {"config.json": b"{}", "README.md": b"# model", "model.safetensors.bak": USER_BYTES}
    for name, data in mine.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    result = ckptlib.export(src, out, format=second, model_only=True, force=True)
    after = _snapshot(out)
    assert sorted(after) == sorted([*mine, *result.files, EXPORT_RECORD])
    assert all(after[name] == data for name, data in mine.items())
    if second == "torch":
        assert "model.safetensors" not in after  # the earlier export's file, listed in its record


def test_without_force_the_earlier_export_is_refused_as_before(tmp_path, src):
    out = str(tmp_path / "hf")
    ckptlib.export(src, out, format="safetensors", model_only=True)
    before = _snapshot(out)
    with pytest.raises(CheckpointExistsError, match="already holds an export"):
        ckptlib.export(src, out, format="torch", model_only=True)
    assert _snapshot(out) == before
