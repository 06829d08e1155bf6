"""`read_once="auto"`, the default, decided by what a byte costs (`ckptlib.loading.read_cost`):
read once from object stores, network filesystems and copies; every rank reads for itself
from a local disk. The 4-rank byte sums per layout, local and S3, are in
tests/elastic/test_read_once_layouts.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import StateError
from ckptlib.format.read.copies import Copy
from ckptlib.loading import read_cost
from ckptlib.offline.plan_load import plan_load
from ckptlib.storage import open_storage
from ckptlib.storage.local import LocalStorage

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /mnt/shared rw,relatime shared:9 - nfs4 server:/export rw,vers=4.2
31 30 8:2 / /mnt/shared/scratch rw,relatime shared:10 - xfs /dev/sdb1 rw
32 22 0:41 / /mnt/my\\040data rw,relatime shared:11 - lustre 10.0.0.1@tcp:/fs rw
33 22 0:42 / /mnt/bucket rw,nosuid shared:12 - fuse.s3fs s3fs rw
34 22 0:43 / /dev/shm rw,nosuid shared:13 - tmpfs tmpfs rw
"""


@pytest.fixture
def mountinfo(tmp_path, monkeypatch):
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTINFO)
    monkeypatch.setattr(read_cost, "MOUNTINFO", str(path))
    return str(path)


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/user/run", "ext4"),
        ("/mnt/shared/run1/step_0000000010", "nfs4"),
        ("/mnt/shared", "nfs4"),
        ("/mnt/shared/scratch/run", "xfs"),  # the deepest mount holding it
        ("/mnt/sharedfoo/run", "ext4"),  # a prefix of the name is not a parent
        ("/mnt/my data/run", "lustre"),  # an octal escape in the mount point
        ("/mnt/bucket/run", "fuse.s3fs"),
        ("/dev/shm/ckpt", "tmpfs"),
    ],
)
def test_the_filesystem_of_a_path_is_its_deepest_mount(mountinfo, path, kind):
    assert read_cost.filesystem_type(path, mountinfo) == kind


def test_an_unreadable_mountinfo_is_a_local_disk(tmp_path):
    assert read_cost.filesystem_type("/anything", str(tmp_path / "absent")) == ""
    assert read_cost.wanted("auto", LocalStorage(str(tmp_path)), None) is False


@pytest.mark.parametrize(
    ("root", "once"),
    [
        ("/home/user/run", False),
        ("/dev/shm/ckpt", False),
        ("/mnt/shared/run1", True),
        ("/mnt/my data/run", True),
        ("/mnt/bucket/run", True),
        ("/mnt/shared/scratch/run", False),
    ],
    ids=["ext4", "tmpfs", "nfs4", "lustre", "fuse", "xfs-under-nfs"],
)
def test_auto_reads_once_from_a_network_filesystem_only(mountinfo, root, once):
    assert read_cost.wanted("auto", LocalStorage(root), None) is once


def test_auto_reads_once_from_object_stores_and_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert read_cost.wanted("auto", open_storage("s3://bucket/run"), None) is True
    local = LocalStorage(str(tmp_path))
    assert read_cost.wanted("auto", local, [Copy("local", local)]) is True
    for setting in (True, False):  # an explicit choice is kept
        assert read_cost.wanted(setting, open_storage("s3://bucket/run"), None) is setting
        assert read_cost.wanted(setting, local, None) is setting


@pytest.mark.parametrize("bad", ["yes", 1, None, "AUTO"])
def test_read_once_refuses_other_values_before_reading(tmp_path, bad):
    message = f"read_once must be True, False or 'auto', got {bad!r}"
    with pytest.raises(StateError, match=re.escape(message)):
        ckptlib.load(str(tmp_path / "not-there"), {"w": torch.zeros(2)}, read_once=bad)
    with pytest.raises(StateError, match=re.escape(message)):
        plan_load(str(tmp_path / "not-there"), 2, read_once=bad)


def _replicated() -> dict:
    return {"model": {f"w{i}": torch.full((128, 256), float(i)) for i in range(4)}, "step": 3}


def _load_default(path: str) -> dict:
    state = {"model": {k: torch.zeros_like(v) for k, v in _replicated()["model"].items()}, "step": -1}
    result = ckptlib.load(path, state)
    return {
        "exact": all(torch.equal(state["model"][k], v) for k, v in _replicated()["model"].items()),
        "rank": dist.get_rank(),
        "read": result.storage_bytes_read,
        "needed": result.bytes_needed,
        "received": result.bytes_received,
        "read_once": result.read_once,
    }


def test_the_default_warm_local_load_reads_directly(tmp_path, dist_run):
    """A replicated state on a local disk at 4 ranks: by default every rank reads all of it
    itself (no exchange), as `read_once=False` does, and `LoadResult.read_once` says so."""
    path = str(tmp_path / "c")
    ckptlib.save(path, _replicated())
    results = dist_run(4, _load_default, path, timeout=120)
    needed = results[0]["needed"]
    assert all(r["exact"] for r in results)
    assert [r["read_once"] for r in results] == [False] * 4
    assert [r["read"] for r in results] == [needed] * 4 and all(r["received"] == 0 for r in results)


def test_a_single_process_load_does_not_read_once(tmp_path):
    path = str(tmp_path / "c")
    ckptlib.save(path, _replicated())
    result = ckptlib.load(path, _replicated(), read_once=True)
    assert result.read_once is False  # nobody to share with
