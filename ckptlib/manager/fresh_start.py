"""When a manager's `load()` finds nothing to resume: say so where it looks like a mistake.

A root that does not exist, or an empty one whose parent directory holds other runs' roots,
is most often a typo in the path (`/runs/AA` for `/runs/A`): the job would silently train
from step 0. That is a FreshStartWarning naming the path; `load(require=True)` makes any
fresh start a CheckpointNotFoundError instead."""

from __future__ import annotations

import os

from ckptlib.errors import CheckpointNotFoundError
from ckptlib.format.native.root import LATEST, parse_step
from ckptlib.storage.base import Storage, list_top

#: How many of the parent's other roots the warning names.
_NAMED = 5


class FreshStartWarning(UserWarning):
    """`CheckpointManager.load` found nothing to resume at a root that looks mistyped: it does
    not exist, or it is empty while its parent holds other runs' roots."""


def fresh_start_reason(storage: Storage, uri: str) -> tuple[str, bool]:
    """Why `uri` has nothing to resume, and whether that looks like a mistake (warned)."""
    try:
        exists = storage.exists()
        empty = exists and not storage.list_children() and not list_top(storage)
    except OSError:
        exists, empty = True, False  # unreadable: the load said so already where it mattered
    if not exists:
        return "it does not exist", True
    if empty:
        siblings = _sibling_roots(storage.local_path())
        if siblings:
            shown = ", ".join(siblings[:_NAMED]) + (", ..." if len(siblings) > _NAMED else "")
            return f"it is empty, while its parent holds other runs' roots ({shown})", True
        return "it is empty", False
    return "it holds no committed step", False


def _sibling_roots(path: str | None) -> list[str]:
    """Names of the directories beside local root `path` that hold a manager's steps."""
    if path is None:
        return []
    parent, own = os.path.split(os.path.normpath(path))
    try:
        entries = sorted(os.scandir(parent or "."), key=lambda e: e.name)
    except OSError:
        return []
    found = []
    for entry in entries:
        if entry.name == own or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            names = os.listdir(entry.path)
        except OSError:
            continue
        if LATEST in names or any(parse_step(name) is not None for name in names):
            found.append(entry.name)
    return found


def nothing_to_resume(uri: str, reason: str) -> CheckpointNotFoundError:
    """The error of `load(require=True)` at a root without a committed step."""
    return CheckpointNotFoundError(
        f"{uri}: nothing to resume ({reason}); load(require=True) needs a committed step there",
        path=uri,
    )


def fresh_start_message(uri: str, reason: str) -> str:
    return (
        f"{uri}: nothing to resume ({reason}); training starts from scratch. "
        "Is the root's path right? load(require=True) makes this an error"
    )
