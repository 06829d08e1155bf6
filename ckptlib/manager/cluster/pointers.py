"""A root's `latest` moved off a committed step before that step is replaced.

Replacing a committed step (a rollback's re-save of the step `latest` names, locally or on the
remote) uncommits it before its new files are written. `latest` leaves it first, for the newest
other committed step in commit order, so a crash or a cut anywhere in between never leaves
`latest` naming a step without its manifest (mosaicml/composer#3376: a pointer names only a
complete, verified copy).
"""

from __future__ import annotations

from ckptlib.errors import CheckpointError
from ckptlib.format.native.manifest import MANIFEST_NAME, Manifest
from ckptlib.format.native.root import LATEST, committed_steps, parse_step, step_dir
from ckptlib.storage.base import Storage


def move_latest_off(storage: Storage, step: int, *, whole: bool) -> str | None:
    """When the `latest` of the root at `storage` names `step`: point it at the newest other
    committed step (in commit order) whose files are there at their recorded sizes (`whole`:
    every file of its manifest, as on a remote; else every file the root holds, as on a node
    root that holds its own shards), or remove it when there is none. Returns what `latest`
    names afterwards (None: nothing); unchanged when it did not name `step`."""
    pointed = storage.read_pointer(LATEST)
    if parse_step(pointed or "") != step:
        return pointed
    best: tuple[tuple, int] | None = None
    for other in committed_steps(storage):
        if other == step:
            continue
        where = storage.child(step_dir(other))
        try:
            manifest = Manifest.from_bytes(where.read(MANIFEST_NAME), f"{where.uri}/{MANIFEST_NAME}")
            listing = where.list()
        except (FileNotFoundError, CheckpointError):
            continue
        files = manifest.files.items() if whole else [(n, r) for n, r in manifest.files.items() if n in listing]
        if any(listing.get(name) != record.size for name, record in files):
            continue  # not a complete copy: never named by `latest`
        order = manifest.commit_order()
        if best is None or order > best[0]:
            best = (order, other)
    if best is None:
        storage.delete([LATEST])
        return None
    storage.set_pointer(LATEST, step_dir(best[1]))
    return step_dir(best[1])


__all__ = ["move_latest_off"]
