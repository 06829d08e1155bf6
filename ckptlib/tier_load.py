"""Loading one checkpoint version of a cluster tier from the nearest intact copies.

Each rank reads from its own node's root when that node holds every file of the version
("local"), else from the remote ("remote"). Every byte read is checked against the manifest's
CRCs; a damaged copy anywhere makes every rank fall back to the remote copy with a
CopyFallbackWarning (never an error while the remote holds an intact copy).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from . import _dist
from .errors import CheckpointCorruptError, CheckpointNotFoundError, stacklevel_outside_ckptlib
from .format import Manifest
from .loading import LoadResult, load
from .resume import Choice
from .storage import Storage
from .topology import Topology


class CopyFallbackWarning(UserWarning):
    """A copy of a checkpoint file was missing or damaged; the load read another copy."""


def _sources(choice: Choice, manifest: Manifest, topology: Topology, remote: Storage | None) -> str:
    held = choice.holders.get(topology.node, frozenset())
    if len(held) == len(manifest.files):
        return "local"
    if remote is not None and choice.remote:
        return "remote"
    raise CheckpointNotFoundError(
        f"rank {topology.rank}: step {choice.step}: this node holds {len(held)} of its {len(manifest.files)} files "
        "and the remote holds none",
        rank=topology.rank,
    )


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
    """Collective: load `choice` into `state` (see the module docstring); the LoadResult's
    `bytes_by_source` counts the checkpoint bytes each source served, over all ranks."""
    manifest = Manifest.from_bytes(manifest_bytes, f"{local.uri}/ckptlib.json")
    source = _dist.agree(lambda: _sources(choice, manifest, topology, remote), group)
    storage = local if source == "local" else remote
    try:
        result = load(storage, state, process_group=group, **kwargs)
    except CheckpointCorruptError as exc:
        used_local = any(s == "local" for s in _dist.all_gather_object(source, group))
        if not (used_local and remote is not None and choice.remote):
            raise
        warnings.warn(
            f"{exc}; reading step {choice.step} from the remote copy ({remote.uri}) instead",
            CopyFallbackWarning,
            stacklevel=stacklevel_outside_ckptlib(),
        )
        source = "remote"
        result = load(remote, state, process_group=group, **kwargs)
    counts = _dist.all_gather_object(source, group)
    per_rank = (result.bytes or 0) / max(len(counts), 1)
    result.bytes_by_source = {s: int(per_rank * counts.count(s)) for s in ("local", "peer", "remote")}
    return result


__all__ = ["CopyFallbackWarning", "load_version"]
