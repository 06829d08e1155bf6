"""The parts of `read_once="auto"` the layouts tests do not pin down, single process: a path is
resolved through symlinks before its mount is looked up, a later mount on the same point
shadows an earlier one, every mountinfo escape is decoded, malformed lines are skipped, the
coordinator reads once only when every rank asked for it (one rank's local disk makes the whole
load read directly), and `ckpt plan` at one rank never reads once."""

from __future__ import annotations

import os
import types

import pytest

from ckptlib.format.read.read_schedule import LocalReads, plan_roles
from ckptlib.loading import read_cost
from ckptlib.storage.local import LocalStorage

ROOT = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"


def _mountinfo(tmp_path, monkeypatch, text: str) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(ROOT + text)
    monkeypatch.setattr(read_cost, "MOUNTINFO", str(path))
    return str(path)


def test_a_symlink_into_a_network_mount_reads_once(tmp_path, monkeypatch):
    mountinfo = _mountinfo(tmp_path, monkeypatch, "30 22 0:40 / /mnt/shared rw - nfs4 server:/export rw\n")
    link = tmp_path / "ckpt"
    os.symlink("/mnt/shared/run1", link)  # the checkpoint root is a link to the NFS mount
    assert read_cost.filesystem_type(str(link), mountinfo) == "nfs4"
    assert read_cost.wanted("auto", LocalStorage(str(link)), None) is True
    assert read_cost.wanted("auto", LocalStorage(str(tmp_path / "plain")), None) is False


@pytest.mark.parametrize(
    ("first", "second"),
    [("ext4", "nfs4"), ("nfs4", "ext4"), ("lustre", "tmpfs")],
    ids=["over-ext4", "over-nfs", "tmpfs"],
)
def test_a_later_mount_on_the_same_point_shadows_the_earlier(tmp_path, monkeypatch, first, second):
    mountinfo = _mountinfo(
        tmp_path,
        monkeypatch,
        f"30 22 0:40 / /mnt/data rw - {first} a rw\n31 22 0:41 / /mnt/data rw - {second} b rw\n",
    )
    assert read_cost.filesystem_type("/mnt/data/run", mountinfo) == second
    assert read_cost.wanted("auto", LocalStorage("/mnt/data/run"), None) is (second in read_cost.NETWORK_FILESYSTEMS)


@pytest.mark.parametrize(
    ("field", "path"),
    [
        ("/mnt/a\\134b", "/mnt/a\\b/run"),
        ("/mnt/tab\\011x", "/mnt/tab\tx/run"),
        ("/mnt/nl\\012x", "/mnt/nl\nx/run"),
        ("/mnt/sp\\040x", "/mnt/sp x/run"),
    ],
    ids=["backslash", "tab", "newline", "space"],
)
def test_every_mountinfo_escape_is_decoded(tmp_path, monkeypatch, field, path):
    mountinfo = _mountinfo(tmp_path, monkeypatch, f"30 22 0:40 / {field} rw - lustre fs rw\n")
    assert read_cost.filesystem_type(path, mountinfo) == "lustre"


def test_malformed_mountinfo_lines_are_skipped(tmp_path, monkeypatch):
    mountinfo = _mountinfo(
        tmp_path,
        monkeypatch,
        "30 22 0:40 /mnt/short - nfs4 x rw\n"  # 4 fields before the separator
        "31 22 0:41 / /mnt/nosep rw nfs4 x rw\n"  # no separator
        "32 22 0:42 / /mnt/notype rw - \n",  # nothing after it
    )
    for path in ("/mnt/short/run", "/mnt/nosep/run", "/mnt/notype/run"):
        assert read_cost.filesystem_type(path, mountinfo) == "ext4", path


def _plan(read_once: bool, can_exchange: bool = True):
    return types.SimpleNamespace(items=[], storage_data=LocalReads(read_once=read_once, can_exchange=can_exchange))


@pytest.mark.parametrize(
    ("asked", "once"),
    [
        ([True, True, True], True),
        ([True, False, True], False),
        ([False, True, True], False),
        ([True, True, False], False),
        ([False, False, False], False),
        ([True], False),  # nobody to share with
    ],
    ids=["all", "middle-not", "first-not", "last-not", "none", "one-rank"],
)
def test_the_coordinator_reads_once_only_when_every_rank_asked(asked, once):
    roles = plan_roles([_plan(a) for a in asked], {}, lambda *_: None, {})
    assert [r.read_once for r in roles] == [once] * len(asked)


def test_a_rank_that_cannot_exchange_makes_the_load_read_directly():
    roles = plan_roles([_plan(True), _plan(True, can_exchange=False)], {}, lambda *_: None, {})
    assert [r.read_once for r in roles] == [False, False]


def test_a_one_rank_plan_never_reads_once(tmp_path):
    import torch

    import ckptlib
    from ckptlib.offline.plan_load import plan_load

    path = str(tmp_path / "c")
    ckptlib.save(path, {"w": torch.ones(8, 8), "step": 1})
    assert plan_load(path, 1, read_once=True).read_once is False
    assert plan_load(path, 2, read_once=True).read_once is True
