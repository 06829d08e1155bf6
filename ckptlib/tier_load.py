"""Loading one checkpoint version of a cluster tier from the nearest intact copies.

Each rank hands the load engine (`loading.load(copies=, info=)`, see `format.copies`) the
copies it can reach, per file, nearest first:

- a file its own node's root holds: that copy ("local"), then the remote's if it has one;
- a file only other nodes hold: none: a rank of a holding node reads the items and sends
  them over the process group (a peer's replica, or its own files), never the remote;
- a file no node holds: the remote's copy ("remote").

Every byte read is checked against the manifest's CRCs; a missing or damaged copy falls back
to the next one with a CopyFallbackWarning, and only when no copy of a file is intact
anywhere is the load a CopiesExhaustedError. The manifest and `.metadata` are read once
before (`resume.fetch_files`) and handed over, so "0 bytes from the remote" is literal.
"""

from __future__ import annotations

from typing import Any, Mapping

from .format import MANIFEST_NAME, Manifest
from .format.copies import Copies, Copy
from .loading import LoadResult, load
from .resume import Choice
from .storage import Storage
from .topology import Topology


def copies_for(
    choice: Choice, manifest: Manifest, topology: Topology, local: Storage, remote: Storage | None
) -> Copies:
    """This rank's copies of `choice` (see the module docstring)."""
    mine = frozenset(choice.holders.get(topology.node, frozenset()))
    elsewhere = frozenset().union(*[held for node, held in choice.holders.items() if node != topology.node])
    found = []
    if mine:
        found.append(Copy("local", local, files=mine, key=f"node{topology.node}:{local.uri}"))
    if remote is not None and choice.remote:
        found.append(Copy("remote", remote, files=mine | (frozenset(manifest.files) - elsewhere)))
    return Copies(found)


def load_version(
    choice: Choice,
    manifest_bytes: bytes,
    metadata_bytes: bytes,
    topology: Topology,
    local: Storage,
    remote: Storage | None,
    state: Mapping[str, Any],
    group,
    kwargs: dict[str, Any],
) -> LoadResult:
    """Collective: load `choice` into `state` from the nearest copies; the LoadResult's
    `bytes_by_source` counts the bytes each kind of copy served, over every rank."""
    manifest = Manifest.from_bytes(manifest_bytes, f"{local.uri}/{MANIFEST_NAME}")
    copies = copies_for(choice, manifest, topology, local, remote)
    uri = remote if remote is not None and choice.remote and topology.node not in choice.holders else local
    return load(uri, state, process_group=group, copies=copies, info=(manifest_bytes, metadata_bytes), **kwargs)


__all__ = ["copies_for", "load_version"]
