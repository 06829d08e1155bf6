"""Loading one checkpoint version of a cluster tier from the nearest intact copies.

Each rank hands the load engine (`loading.load(copies=, info=)`, see `format.copies`) the
copies it can reach: its own node's root, for the files that node holds ("local", the nearest),
and the remote's copy of every file when the remote has the version ("remote", the farthest).
The engine reads each item from the nearest copy any rank holds, by a rank that holds it, and
sends it to the ranks that need it over the process group: a file only another node holds (a
peer's replica, or its own files) comes from that node, never from the remote; a file no node
holds comes from the remote.

Every byte read is checked against the manifest's CRCs; a missing or damaged copy falls back
to the next one with a CopyFallbackWarning, and only when no copy of a file is intact
anywhere is the load a CopiesExhaustedError. The manifest and `.metadata` are read once
before (`resume.fetch_files`) and handed over, so "0 bytes from the remote" is literal.
"""

from __future__ import annotations

from typing import Any, Mapping

from .format.copies import Copies, Copy
from .loading import LoadResult, load
from .resume import Choice
from .storage import Storage
from .topology import Topology


def copies_for(choice: Choice, topology: Topology, local: Storage, remote: Storage | None) -> Copies:
    """This rank's copies of `choice` (see the module docstring)."""
    mine = frozenset(choice.holders.get(topology.node, frozenset()))
    found = []
    if mine:
        found.append(Copy("local", local, files=mine, key=f"node{topology.node}:{local.uri}"))
    if remote is not None and choice.remote:
        found.append(Copy("remote", remote))
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
    copies = copies_for(choice, topology, local, remote)
    uri = remote if remote is not None and choice.remote and topology.node not in choice.holders else local
    return load(uri, state, process_group=group, copies=copies, info=(manifest_bytes, metadata_bytes), **kwargs)


__all__ = ["copies_for", "load_version"]
