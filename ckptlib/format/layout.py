"""What a checkpoint directory is: committed, incomplete, plain DCP, or not a checkpoint.

The commit protocol: rank 0 writes `ckptlib.pending` before any shard; every rank writes
its shard file; the coordinator writes `.metadata`; rank 0 confirms every file exists with
its recorded size and writes `ckptlib.json` last; then removes the pending marker. A
directory is committed iff its manifest exists and matches the files.
"""

from __future__ import annotations

import dataclasses
import json
import re

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    NotACheckpointError,
)
from ..storage import Storage
from .dcp_io import read_metadata
from .manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME, Manifest

_SHARD_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def shard_rank(name: str) -> int | None:
    match = _SHARD_RE.match(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass
class CheckpointInfo:
    uri: str
    kind: str  # "ckptlib" (manifest, checksums) or "dcp" (plain DCP, no checksums)
    manifest: Manifest | None
    metadata: Metadata

    @property
    def world_size(self) -> int | None:
        if self.manifest is not None:
            return self.manifest.world_size
        ranks = {shard_rank(getattr(info, "relative_path", "")) for info in self.metadata.storage_data.values()}
        ranks.discard(None)
        return (max(ranks) + 1) if ranks else None  # type: ignore[type-var]

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest is not None else None


def _missing_or_resized(manifest: Manifest, listing: dict[str, int]) -> list[str]:
    problems = []
    for name, record in sorted(manifest.files.items()):
        rank = shard_rank(name)
        who = f" (rank {rank}'s shard)" if rank is not None else ""
        if name not in listing:
            problems.append(f"{name}{who} is missing")
        elif listing[name] != record.size:
            problems.append(f"{name}{who} has {listing[name]} bytes, the manifest says {record.size}")
    return problems


def read_manifest(storage: Storage) -> Manifest:
    where = f"{storage.uri}/{MANIFEST_NAME}"
    return Manifest.from_bytes(storage.read(MANIFEST_NAME), where)


def classify(storage: Storage, listing: dict[str, int] | None = None) -> str:
    """One of: missing, empty, committed, incomplete, dcp, other."""
    if not storage.exists():
        return "missing"
    listing = storage.list() if listing is None else listing
    if not listing:
        return "empty"
    if MANIFEST_NAME in listing:
        return "committed"
    if PENDING_NAME in listing or any(shard_rank(n) is not None for n in listing):
        return "incomplete" if METADATA_NAME not in listing or PENDING_NAME in listing else "dcp"
    if METADATA_NAME in listing:
        return "dcp"
    return "other"


def open_checkpoint(storage: Storage, *, verify: bool = True) -> CheckpointInfo:
    """Find out what is at `storage` and read its manifest and metadata, or raise why not."""
    uri = storage.uri
    is_file = getattr(storage, "is_file", None)
    if is_file is not None and is_file():
        raise NotACheckpointError(f"{uri} is a file, not a checkpoint directory", path=uri)
    listing = storage.list() if storage.exists() else {}
    kind = classify(storage, listing)
    if kind == "missing":
        raise CheckpointNotFoundError(f"no checkpoint at {uri}: the path does not exist", path=uri)
    if kind in ("empty", "other"):
        raise NotACheckpointError(
            f"{uri} is not a checkpoint: no {MANIFEST_NAME} and no DCP {METADATA_NAME} in it", path=uri
        )
    if kind == "incomplete":
        raise CheckpointIncompleteError(
            f"{uri} is an uncommitted checkpoint: a save started but never wrote {MANIFEST_NAME} "
            "(crashed or still running)",
            path=uri,
        )
    manifest = None
    if kind == "committed":
        manifest = read_manifest(storage)
        problems = _missing_or_resized(manifest, listing)
        if problems:
            raise CheckpointCorruptError(f"{uri}: files do not match the manifest: " + "; ".join(problems), path=uri)
    metadata = read_metadata(storage, manifest, verify=verify)
    return CheckpointInfo(uri=uri, kind="ckptlib" if manifest else "dcp", manifest=manifest, metadata=metadata)


def prepare_save_target(storage: Storage, *, overwrite: bool, world_size: int) -> None:
    """Make `storage` ready for a new save without ever losing a committed checkpoint."""
    uri = storage.uri
    kind = classify(storage)
    if kind == "committed" and not overwrite:
        raise CheckpointExistsError(f"{uri} already holds a committed checkpoint (pass overwrite=True)", path=uri)
    if kind in ("dcp", "other") and not overwrite:
        raise CheckpointExistsError(
            f"{uri} is not empty and not a ckptlib checkpoint; refusing to write into it", path=uri
        )
    if kind in ("committed", "incomplete", "dcp", "other"):
        storage.delete_tree()  # debris of a crashed save, or an explicit overwrite
    storage.write(PENDING_NAME, json.dumps({"world_size": world_size}).encode())


def commit(storage: Storage, manifest: Manifest) -> None:
    """Publish the manifest after confirming that every rank's files exist with their sizes."""
    listing = storage.list()
    problems = _missing_or_resized(manifest, listing)
    if problems:
        raise CheckpointCorruptError(
            f"{storage.uri}: refusing to commit, " + "; ".join(problems), path=storage.uri
        )
    storage.write(MANIFEST_NAME, manifest.to_bytes())
    storage.delete([PENDING_NAME])
