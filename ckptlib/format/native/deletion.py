"""Deleting a checkpoint: only the files ckptlib (or DCP) writes into a checkpoint directory.

Overwrites, retention, gc and debris cleanup all come here, so none of them can remove a
user's file: a directory is never deleted blindly (a `CheckpointManager` root passed as a
save target, a notes file a user left in a step directory, a sub-directory). What counts as
ours is a fixed set of names: the manifest, the pending marker, `.metadata`, DCP's
`__<rank>_<n>.distcp` shards and the temporary names our writers (and DCP's) use for them.

Order: the manifest first, then `.metadata`, then the rest, so a crash half-way leaves a
directory that looks incomplete (debris the next save or gc removes), never one that looks
committed with files missing. The directory itself is removed only when nothing else is in it.
"""

from __future__ import annotations

import re
from typing import Iterable

from ckptlib.errors import OverwriteRefusedError
from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME
from ckptlib.storage.base import Storage

_OWN_RE = re.compile(
    r"^(?:ckptlib\.json|ckptlib\.pending|\.metadata|__\d+_\d+\.distcp)"
    r"(?:\.tmp-[0-9a-f]{8})?$"  # LocalStorage.write's temporary names
    r"|^\.metadata\.tmp$"  # DCP FileSystemWriter's temporary metadata
)


def is_own_file(name: str) -> bool:
    """Whether `name` (relative to a checkpoint directory) is a file ckptlib or DCP writes there."""
    return "/" not in name and _OWN_RE.match(name) is not None


def foreign_files(listing: Iterable[str]) -> list[str]:
    """The names in a checkpoint directory's listing that ckptlib did not write, sorted."""
    return sorted(name for name in listing if not is_own_file(name))


def _deletion_order(name: str) -> int:
    base = name.split(".tmp-")[0]
    return 0 if base == MANIFEST_NAME else 1 if base == METADATA_NAME else 3 if base == PENDING_NAME else 2


def describe_foreign(uri: str, foreign: list[str]) -> str:
    """Why `uri` is no checkpoint ckptlib may delete, naming what is in it."""
    shown = ", ".join(foreign[:8]) + (f" ... ({len(foreign)} in all)" if len(foreign) > 8 else "")
    nested = sorted({name.split("/")[0] for name in foreign if "/" in name})
    managed = [n for n in nested if n.startswith("step_") or any(f.startswith(f"{n}/{MANIFEST_NAME}") for f in foreign)]
    what = " (it looks like a CheckpointManager root: it holds step directories)" if managed else ""
    return f"{uri} holds files ckptlib did not write{what}: {shown}"


def refuse_foreign(storage: Storage, listing: dict[str, int], action: str, *, checkpoint: bool = True) -> None:
    """OverwriteRefusedError naming the foreign files when `listing` holds any (`checkpoint`:
    whether the rest of the directory is a checkpoint)."""
    foreign = foreign_files(listing)
    if foreign:
        lead = "" if checkpoint else f"{storage.uri} is not empty and not a ckptlib checkpoint: "
        raise OverwriteRefusedError(
            f"{lead}{describe_foreign(storage.uri, foreign)}; refusing to {action} "
            "(only a checkpoint directory holding "
            "nothing but a checkpoint's own files can be replaced; nothing was touched)",
            path=storage.uri,
        )


def remove_checkpoint(storage: Storage, listing: dict[str, int] | None = None) -> list[str]:
    """Delete the checkpoint files at `storage` (see the module docstring), then the directory if
    it is empty. Returns the foreign files left in place (the directory stays with them)."""
    if listing is None:
        listing = storage.list() if storage.exists() else {}
    own = sorted((name for name in listing if is_own_file(name)), key=lambda n: (_deletion_order(n), n))
    foreign = foreign_files(listing)
    for phase in sorted({_deletion_order(n) for n in own}):
        storage.delete([n for n in own if _deletion_order(n) == phase])
    if not foreign and not storage.list():
        storage.delete_tree()  # the empty directory (and, on S3, unfinished uploads under it)
    return foreign


def remove_failed_save(storage: Storage, *, shard: str | None, coordinator: bool, prepared: bool) -> None:
    """Best effort, on every rank after a save failed (ENOSPC, a rank's error): remove what this
    save wrote so a full disk does not stay full. Never touches a checkpoint that committed
    (the manifest is there: the failure came after the commit), nor anything when the target
    was never prepared (a refused overwrite).

    Each rank removes `shard`, the shard file it started and did not finish (its writer
    usually did already); a finished shard is left to the coordinator, which alone knows
    whether the commit is still under way (a rank that times out must never delete a file of
    a checkpoint the coordinator is committing). The coordinator (`prepared`: its prepare
    step ran) removes every file of the failed save."""
    try:
        if MANIFEST_NAME in storage.list(MANIFEST_NAME):
            return
        if shard is not None:
            storage.delete([shard])
        if coordinator and prepared:
            listing = storage.list()
            if MANIFEST_NAME not in listing:
                remove_checkpoint(storage, listing)
    except Exception:  # noqa: BLE001 - the save's own error is what the caller raises
        pass


__all__ = [
    "remove_failed_save",
    "describe_foreign",
    "foreign_files",
    "is_own_file",
    "refuse_foreign",
    "remove_checkpoint",
]
