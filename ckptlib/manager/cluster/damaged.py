"""Node-local copies found damaged are set aside, so that nothing trusts them again.

A load that read past a node's copy of a file (missing, short, not matching its manifest:
`LoadResult.unusable_copies`), or an upload that found it so, has that node's copy checked
once more against the manifest; when it still does not match it is renamed to
`<file>.damaged` (deleted on a root that is not a directory). The next inventory then counts
the node as not holding the file, so no resumed upload, replica or later load reads it, and
the file is uploaded from another node's copy instead. A copy that matches on the second
look (a read that failed once) stays. Only files the tier's own manifest lists are touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from ckptlib.errors import CopyFallbackWarning, DamagedCopyError, warn_scrubbed
from ckptlib.format.native.manifest import Manifest
from ckptlib.manager.cluster.remote_tier import remote_matches
from ckptlib.manager.cluster.topology import Topology
from ckptlib.storage.base import Storage

DAMAGED_SUFFIX = ".damaged"


def node_key(node: int, local_uri: str) -> str:
    """The copy key of node `node`'s copy of a step directory (see `resume.copies_for`)."""
    return f"node{node}:{local_uri}"


def damaged_by_node(unusable: Iterable, topology: Topology) -> dict[int, frozenset[str]]:
    """Node -> files of its copy that a load could not use (from `LoadResult.unusable_copies`;
    by the key's node alone: each node's root may sit at another path)."""
    nodes = {node_key(node, ""): node for node in range(len(topology.nodes))}
    found: dict[int, set[str]] = {}
    for copy in unusable:
        node = nodes.get(copy.key.partition(":")[0] + ":") if copy.label == "local" else None
        if node is not None:
            found.setdefault(node, set()).add(copy.file)
    return {node: frozenset(files) for node, files in found.items()}


def set_aside(step_root: Storage, name: str, manifest: Manifest) -> bool:
    """Whether this node's copy of `name` is unusable (missing, or still not matching the
    manifest on a second read); a damaged one is renamed to `<name>.damaged`."""
    record = manifest.files.get(name)
    if record is None:
        return False
    if remote_matches(step_root, name, record.size, record.crc32):
        return False
    path = step_root.local_path(name)
    try:
        if path is None:
            step_root.delete([name])
        elif os.path.exists(path):
            os.replace(path, path + DAMAGED_SUFFIX)
            warn_scrubbed(
                f"{step_root.uri}/{name} does not match its manifest: set aside as {name}{DAMAGED_SUFFIX} "
                "(no later load, replica or upload of the tier reads it)",
                CopyFallbackWarning,
            )
    except OSError as exc:
        warn_scrubbed(f"{step_root.uri}/{name}: could not set the damaged copy aside: {exc}", CopyFallbackWarning)
    return True


def without(holders: Mapping[int, frozenset[str]], damaged: Mapping[int, frozenset[str]]) -> dict[int, frozenset[str]]:
    """`holders` (node -> files held) less the `damaged` copies."""
    return {node: frozenset(files) - damaged.get(node, frozenset()) for node, files in holders.items()}


def reassign(
    exc: DamagedCopyError,
    assignment: Mapping[int, list[str]],
    holders: Mapping[int, frozenset[str]],
    topology: Topology,
) -> tuple[dict[int, list[str]], dict[int, frozenset[str]]]:
    """After an upload found `exc.file` damaged on `exc.rank`'s node: the upload's new
    assignment (rank -> files), the file given to the least busy rank of the lowest other node
    holding it, and the holders without that copy. Raises `exc` when no other copy is left.
    The same on every rank (every rank got the same error)."""
    assert exc.rank is not None
    bad = topology.node_of(exc.rank)
    holders = without(holders, {bad: frozenset([exc.file])})
    others = [node for node in sorted(holders) if exc.file in holders[node]]
    if not others:
        raise exc
    members = topology.nodes[others[0]]
    out = {rank: [f for f in files if f != exc.file] for rank, files in assignment.items()}
    rank = min(members, key=lambda r: (len(out.get(r, [])), r))
    out.setdefault(rank, []).append(exc.file)
    return out, holders


__all__ = ["DAMAGED_SUFFIX", "damaged_by_node", "node_key", "reassign", "set_aside", "without"]
