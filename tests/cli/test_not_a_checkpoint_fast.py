"""`ckpt verify|inspect` (and a load, convert or export) of a large directory that is not a
checkpoint says so from the files directly in it, without walking the tree below it (minutes
on network filesystems and big prefixes): locally no directory below it is scanned; on every
object store no listing below its top level is requested.

Before: detection listed every file under the directory, recursively, before saying "is not
a checkpoint".
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.storage import Faults

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.errors import NotACheckpointError
from ckptlib.storage import open_storage


def _big_tree(root: str) -> None:
    os.makedirs(root)
    with open(os.path.join(root, "README.md"), "w") as f:
        f.write("a dataset, not a checkpoint\n")
    for d in range(20):
        sub = os.path.join(root, f"shard{d:02d}", "deeper")
        os.makedirs(sub)
        for i in range(10):
            with open(os.path.join(sub, f"part{i}.bin"), "wb") as f:
                f.write(b"x")


@pytest.fixture
def scanned(monkeypatch) -> list[str]:
    """Every directory os.scandir / os.listdir / os.walk is asked to read from now on."""
    seen: list[str] = []
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path="."):
        seen.append(os.path.abspath(os.fspath(path)))
        return real_scandir(path)

    def listdir(path="."):
        seen.append(os.path.abspath(os.fspath(path)))
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    return seen


ACTIONS = {
    "ckpt-verify": lambda big: cli_main(["verify", big, "--no-progress"]),
    "ckpt-inspect": lambda big: cli_main(["inspect", big]),
    "load": lambda big: ckptlib.load(big, {"w": torch.zeros(2)}),
    "export": lambda big: ckptlib.export(big, big + "-hf"),
    "convert": lambda big: ckptlib.convert(big, big + "-dcp"),
}


@pytest.mark.parametrize("action", list(ACTIONS))
def test_a_large_local_directory_is_refused_without_walking_it(tmp_path, capsys, scanned, action):
    big = str(tmp_path / "dataset")
    _big_tree(big)
    scanned.clear()
    try:
        outcome = ACTIONS[action](big)
    except NotACheckpointError as exc:
        assert "is not a checkpoint" in str(exc) and exc.path == big, str(exc)
    else:
        assert outcome == 2  # the CLI's "no checkpoint at URI"
        assert "is not a checkpoint" in capsys.readouterr().err
    below = [p for p in scanned if p.startswith(big + os.sep)]
    assert below == [], below[:5]


@pytest.mark.parametrize("cloud", ["s3", "gcs", "azure"])
def test_a_large_prefix_is_refused_with_one_top_level_listing(request, monkeypatch, cloud):
    pytest.importorskip({"s3": "boto3", "gcs": "google.cloud.storage", "azure": "azure.storage.blob"}[cloud])
    root = request.getfixturevalue(f"{cloud}_root")
    storage = open_storage(root)
    storage.write("README.md", b"not a checkpoint")
    for d in range(5):
        for i in range(3):
            storage.write(f"shard{d}/deeper/part{i}.bin", b"x")
    faults = Faults.install(monkeypatch, storage)
    for argv in (["verify", root, "--no-progress"], ["inspect", root]):
        assert cli_main(argv) == 2
    assert faults.count("list") == 0, faults.calls  # never a listing of everything below the prefix
    assert faults.count("list_top") >= 1
