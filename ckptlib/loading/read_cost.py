"""Whether a load reads once: `read_once="auto"` (the default) decided by what a byte costs.

Read-once (one rank reads an item several ranks need and sends it over the process group)
saves storage bytes at the price of the exchange; it pays where bytes cost more than the
group's: object stores (each GET is billed and bounded by the network) and network
filesystems (NFS, Lustre, GPFS, ...). On a local disk a re-read comes from the page cache and
is faster than the exchange over gloo (2.7-3.6x faster at 4 ranks, `ckpt bench read-once`),
so there every rank reads what it needs itself. Loads given copies (the cluster tier) read
once: a copy may be remote, and the schedule reads every rank's cheapest copy first.

Each rank decides for its own storage; the load's coordinator reads once only when every rank
asked for it (`read_schedule.plan_roles`), so the decision is the same on every rank and is
reported as `LoadResult.read_once`.
"""

from __future__ import annotations

import os
from typing import Any

from ckptlib.errors import StateError
from ckptlib.storage.local import LocalStorage

#: Filesystem types (as /proc/self/mountinfo names them) whose bytes travel over a network.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "9p",
        "afs",
        "orangefs",
        "pvfs2",
        "wekafs",
        "panfs",
        "virtiofs",
    }
)

MOUNTINFO = "/proc/self/mountinfo"


def wanted(setting: Any, storage: Any, copies: Any) -> bool:
    """This rank's read-once request for `read_once=setting` on `storage` (with `copies`)."""
    check(setting)
    if setting is True or setting is False:
        return setting
    if copies is not None or not isinstance(storage, LocalStorage):
        return True
    kind = filesystem_type(storage.root)
    return kind in NETWORK_FILESYSTEMS or kind.startswith("fuse.")


def check(setting: Any) -> None:
    """Refuse a `read_once=` that is not True, False or "auto" (before any collective)."""
    if not (setting is True or setting is False or (isinstance(setting, str) and setting == "auto")):
        raise StateError(f"read_once must be True, False or 'auto', got {setting!r}")


def filesystem_type(path: str, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding `path` ("" when unknown: treated as a local disk)."""
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return ""
    target = os.path.realpath(path)
    best, kind = -1, ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:  # the deepest mount point holding it (later ones shadow earlier)
            best, kind = len(point), tail[0]
        elif inside and len(point) == best:
            kind = tail[0]
    return kind


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


__all__ = ["NETWORK_FILESYSTEMS", "check", "filesystem_type", "wanted"]
