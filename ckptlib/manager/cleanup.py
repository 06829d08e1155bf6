"""Retention and debris removal in a CheckpointManager root: which step directories go.

Committed steps the retention policy does not keep go, and so does debris: a step directory
whose save never committed, and what a crashed deletion left (`step_*.deleting-*`). The step
`latest` names and the steps the caller protects (the save just committed) never go,
whatever the policy says. `fence(what)` runs before each deletion (a lock holder's check
that the root is still its own: `RootLock.fence`) and stops the rest by raising. Only a
checkpoint's own files are deleted (`format.deletion`): a step directory holding files
ckptlib did not write keeps them, with a ForeignFilesWarning.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from ckptlib.errors import CheckpointError, stacklevel_outside_ckptlib
from ckptlib.format.native.deletion import describe_foreign, foreign_files, remove_checkpoint
from ckptlib.format.native.manifest import MANIFEST_NAME, PENDING_NAME, Manifest
from ckptlib.format.native.root import DELETING_RE, LATEST, parse_step, scan, step_dir
from ckptlib.manager.policies import RetentionPolicy, StepRecord, to_delete
from ckptlib.storage.base import Storage


class ForeignFilesWarning(UserWarning):
    """Retention or gc removed a step's checkpoint files but left files ckptlib did not write
    (and their directory) in place."""


def collect(
    storage: Storage,
    root_uri: str,
    retention: RetentionPolicy,
    *,
    protect: set[int],
    dry_run: bool = False,
    on_removed: Callable[[int, int], None] | None = None,
    fence: Callable[[str], None] | None = None,
) -> list[str]:
    """Apply `retention` and remove debris in the root at `storage`; returns the step
    directories removed (or, `dry_run`, that would be): only those gone, never one kept for
    files ckptlib did not write (its own files are removed and a ForeignFilesWarning names
    the rest; a dry run warns alike). Never removes what `latest` names or `protect`.
    `on_removed(done, total)` follows the deletions (a progress bar)."""
    steps = scan(storage)
    pointed = parse_step(storage.read_pointer(LATEST) or "")
    protected = set(protect) | ({pointed} if pointed is not None else set())
    uses_metrics = getattr(retention, "uses_metrics", True)
    records = [
        StepRecord(s.step, saved_metrics(storage, s.name) if uses_metrics else {})
        for s in steps
        if s.state == "committed"
    ]
    doomed = {s: step_dir(s) for s in to_delete(retention, records, protected)}
    for info in steps:
        if info.state == "incomplete" and info.step not in protected:
            doomed[info.step] = info.name
    leftovers = [n for n in storage.list_children() if DELETING_RE.match(n)]
    listings = {info.name: info.files for info in steps}
    removed: list[str] = []
    kept: dict[str, list[str]] = {}
    total = len(doomed) + len(leftovers)
    if on_removed is not None and not dry_run:
        on_removed(0, total)
    for done, name in enumerate([*doomed.values(), *leftovers], 1):  # leftovers: a deletion that crashed
        if dry_run:  # what remove_checkpoint would leave: the files ckptlib did not write
            listing = listings.get(name)
            foreign = foreign_files(storage.child(name).list() if listing is None else listing)
            gone = not foreign
        else:
            if fence is not None:
                fence(f"remove {name}")
            foreign = remove_checkpoint(storage.child(name))
            gone = not storage.child(name).exists()  # reported only when it is gone
            if on_removed is not None:
                on_removed(done, total)
        if foreign:
            kept[name] = foreign
        if gone:
            removed.append(name)
    if not dry_run:
        for info in steps:  # a commit that crashed between writing the manifest and this
            if info.state == "committed" and info.step not in doomed and PENDING_NAME in info.files:
                if fence is not None:
                    fence(f"remove the pending marker of {info.name}")
                storage.child(info.name).delete([PENDING_NAME])
    verb = (
        "would remove the checkpoint's own files and leave"
        if dry_run
        else "removed the checkpoint's own files and left"
    )
    for name, foreign in kept.items():
        warnings.warn(
            f"{describe_foreign(f'{root_uri}/{name}', foreign)}; {verb} the directory with those in place",
            ForeignFilesWarning,
            stacklevel=stacklevel_outside_ckptlib(),
        )
    return sorted(n for n in doomed.values() if n in removed) + sorted(n for n in leftovers if n in removed)


def saved_metrics(storage: Storage, name: str) -> dict[str, Any]:
    """The metrics in a step's manifest; {} when it has none or cannot be read (never fatal)."""
    where = f"{storage.uri.rstrip('/')}/{name}/{MANIFEST_NAME}"
    try:
        return dict(Manifest.from_bytes(storage.child(name).read(MANIFEST_NAME), where).metrics)
    except (CheckpointError, OSError):
        return {}


__all__ = ["ForeignFilesWarning", "collect", "saved_metrics"]
