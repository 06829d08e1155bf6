"""What a checkpoint directory is: committed, incomplete, plain DCP, or not a checkpoint.

The commit protocol: rank 0 writes `ckptlib.pending` before any shard; every rank writes
its shard file; the coordinator writes `.metadata`; rank 0 confirms every file exists with
its recorded size and writes `ckptlib.json` last; then removes the pending marker. A
directory is committed iff its manifest exists and matches the files.

A directory whose `.metadata` is marked as ckptlib's but that has no manifest is not plain
DCP: its manifest was deleted, or a save or a deletion (S3 deletes object by object) was
interrupted. `classify` calls it incomplete (debris for the manager) and `open_checkpoint`
refuses it, so it never loads unverified.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import zlib
from typing import TYPE_CHECKING, Any

from ckptlib._version import __version__
from ckptlib.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointRemovedError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from ckptlib.format.native.deletion import is_own_file
from ckptlib.format.native.file_names import describe_file, shard_rank
from ckptlib.format.native.manifest import (
    MANIFEST_NAME,
    METADATA_MARKER,
    METADATA_NAME,
    PENDING_NAME,
    FileRecord,
    Manifest,
)
from ckptlib.storage.base import Storage, list_top, root_is_file

if TYPE_CHECKING:  # torch is imported where a function needs it: `ckpt ls` reads manifests without it
    from torch.distributed.checkpoint.metadata import Metadata


def is_ckptlib_metadata(metadata: Any) -> bool:
    """Whether `.metadata` was written by ckptlib's CkptWriter (which also writes a manifest)."""
    modules = getattr(getattr(metadata, "storage_meta", None), "modules", None)
    return isinstance(modules, (list, tuple)) and METADATA_MARKER in modules


def read_metadata(
    storage: Storage, manifest: Manifest | None, *, verify: bool = True, listed_size: int | None = None
) -> Metadata:
    """Read and safely unpickle `.metadata`, checking it against the manifest first.
    `listed_size`: its size in a listing just taken, if known (saves a second read)."""
    return _read_metadata(storage, manifest, verify=verify, listed_size=listed_size)[0]


def _read_metadata(
    storage: Storage, manifest: Manifest | None, *, verify: bool, listed_size: int | None
) -> tuple[Metadata, bytes]:
    where = f"{storage.uri}/{METADATA_NAME}"
    record = manifest.files.get(METADATA_NAME) if manifest is not None and verify else None
    try:
        if record is None:
            blob = storage.read(METADATA_NAME)  # bounded by the file's size
        else:  # never more than the manifest records, plus one byte to tell a larger file, unless
            # the listing already told its size: a read past the end costs a second one (on S3
            # a second GET of a file that grows as ranks x tensors)
            extra = 0 if listed_size == record.size else 1
            try:
                blob = storage.read(METADATA_NAME, 0, record.size + extra)
            except EOFError:
                blob = storage.read(METADATA_NAME)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where}: DCP metadata file is missing", path=where) from exc
    if manifest is not None and verify:
        record = manifest.files.get(METADATA_NAME)
        if record is None:
            raise CheckpointCorruptError(f"{where}: not listed in the manifest", path=where)
        if len(blob) != record.size or zlib.crc32(blob) != record.crc32:
            raise CheckpointCorruptError(
                f"{where}: checksum mismatch (size {len(blob)} vs {record.size} in the manifest)", path=where
            )
    metadata = _safe_loads(blob, where)
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where}: holds {type(metadata).__name__}, not DCP Metadata", path=where)
    return metadata, blob


@dataclasses.dataclass
class CheckpointInfo:
    uri: str
    kind: str  # "ckptlib" (manifest, checksums) or "dcp" (plain DCP, no checksums)
    manifest: Manifest | None
    metadata: Metadata
    # The verified bytes `manifest` and `metadata` were read from (`open_checkpoint`), and those
    # two objects: while they are still the ones held, the info pickles as the bytes.
    raw: tuple[bytes | None, bytes, Manifest | None, Metadata] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    def __reduce_ex__(self, protocol):
        """Sent to the other ranks of a load (`decide_on_rank0`) as the bytes rank 0 read and
        checked, which each rank parses: pickling the Metadata again cost rank 0 as much as
        reading it (issue 25.5). Subclasses (other formats' infos) pickle as usual."""
        if type(self) is not CheckpointInfo:
            return super().__reduce_ex__(protocol)
        raw = self.raw
        if raw is None or raw[2] is not self.manifest or raw[3] is not self.metadata:
            return CheckpointInfo, (self.uri, self.kind, self.manifest, self.metadata)
        return _info_from_bytes, (self.uri, self.kind, raw[0], raw[1])

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


def _info_from_bytes(uri: str, kind: str, manifest_blob: bytes | None, metadata_blob: bytes) -> CheckpointInfo:
    manifest = None if manifest_blob is None else Manifest.from_bytes(manifest_blob, f"{uri}/{MANIFEST_NAME}")
    return CheckpointInfo(uri, kind, manifest, _safe_loads(metadata_blob, f"{uri}/{METADATA_NAME}"))


def _missing_or_resized(manifest: Manifest, listing: dict[str, int]) -> list[tuple[str, str]]:
    """(file name, problem) for every manifest file that is absent or has another size."""
    problems = []
    for name, record in sorted(manifest.files.items()):
        if name not in listing:
            problems.append((name, f"{describe_file(name)} is missing"))
        elif listing[name] != record.size:
            problems.append((name, f"{describe_file(name)} has {listing[name]} bytes, the manifest says {record.size}"))
    return problems


def read_manifest(storage: Storage) -> Manifest:
    return _read_manifest(storage)[0]


def _read_manifest(storage: Storage) -> tuple[Manifest, bytes]:
    where = f"{storage.uri}/{MANIFEST_NAME}"
    try:
        blob = storage.read(MANIFEST_NAME)
    except FileNotFoundError as exc:  # listed a moment ago: another process removed the checkpoint
        raise CheckpointRemovedError(
            f"{where} disappeared while it was read: the checkpoint was removed (by another process's retention "
            "or gc?)",
            path=storage.uri,
        ) from exc
    return Manifest.from_bytes(blob, where), blob


def _marked_by_ckptlib(storage: Storage) -> bool:
    """Whether `.metadata` says ckptlib wrote it (unreadable or unsafe metadata: no; loading it
    raises the real error later)."""
    try:
        return is_ckptlib_metadata(_safe_loads(storage.read(METADATA_NAME), f"{storage.uri}/{METADATA_NAME}"))
    except (CheckpointError, OSError, EOFError):
        return False


def classify(storage: Storage, listing: dict[str, int] | None = None) -> str:
    """One of: missing, empty, committed, incomplete, dcp, other.

    incomplete: a save that never committed (pending marker, or shards without `.metadata`),
    or a ckptlib checkpoint without its manifest (see the module docstring).
    """
    if listing is None:
        if not storage.exists():
            return "missing"
        listing = storage.list()
    elif not listing and not storage.exists():
        return "missing"
    if not listing:
        return "empty"
    if MANIFEST_NAME in listing:
        return "committed"
    if PENDING_NAME in listing or any(shard_rank(n) is not None for n in listing):
        if METADATA_NAME not in listing or PENDING_NAME in listing:
            return "incomplete"
    elif METADATA_NAME not in listing:
        # Nothing but the temporary names ckptlib writes its files through: a save killed as it
        # wrote its pending marker (debris to remove, as the crash harness found).
        return "incomplete" if all(is_own_file(n) for n in listing) else "other"
    return "incomplete" if _marked_by_ckptlib(storage) else "dcp"


def _file_kind(path: str) -> str:
    mode = os.stat(path).st_mode
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file or directory"


def not_a_checkpoint_error(storage: Storage, kind: str) -> CheckpointError | None:
    """The error for a `classify` kind that is no checkpoint at all (missing, a file, empty,
    unrelated files), or None."""
    uri = storage.uri
    if root_is_file(storage):
        return NotACheckpointError(f"{uri} is a file, not a checkpoint directory", path=uri)
    if kind == "missing":
        local = storage.local_path()
        if local is not None and os.path.exists(local):  # neither a directory nor a regular file
            return NotACheckpointError(
                f"{uri} is {_file_kind(local)}, not a checkpoint directory; refusing to read it", path=uri
            )
        return CheckpointNotFoundError(f"no checkpoint at {uri}: the path does not exist", path=uri)
    if kind in ("empty", "other"):
        return NotACheckpointError(
            f"{uri} is not a checkpoint: no {MANIFEST_NAME} and no DCP {METADATA_NAME} in it", path=uri
        )
    return None


def open_checkpoint(storage: Storage, *, verify: bool = True, check_files: bool = True) -> CheckpointInfo:
    """Find out what is at `storage` and read its manifest and metadata, or raise why not.

    Checks (cheaply, without reading shards) that every file the manifest lists exists with
    its size (`check_files`), and that `.metadata` is consistent with the manifest and the
    files: its storage records stay inside the directory and their files, and every tensor's
    chunks lie inside it and add up to it (`verify.structure_problems`).
    """
    uri = storage.uri
    # What it is, from the files directly in it (all of a checkpoint's are there): a large
    # directory that is no checkpoint is refused without listing the tree below it.
    kind = classify(storage, list_top(storage)) if storage.exists() else "missing"
    error = not_a_checkpoint_error(storage, kind)
    if error is not None:
        raise error
    listing = storage.list()
    if kind == "incomplete":
        if PENDING_NAME in listing or METADATA_NAME not in listing:
            raise CheckpointIncompleteError(
                f"{uri} is an uncommitted checkpoint: a save started but never wrote {MANIFEST_NAME} "
                "(crashed or still running)",
                path=uri,
            )
        where = f"{uri}/{MANIFEST_NAME}"
        raise CheckpointCorruptError(
            f"{where} is missing: {METADATA_NAME} says ckptlib wrote this checkpoint, but without its manifest "
            "its files cannot be verified (the manifest was deleted, or a save or deletion was interrupted); "
            "refusing to load it as plain DCP",
            path=where,
        )
    manifest = manifest_blob = None
    if kind == "committed":
        manifest, manifest_blob = _read_manifest(storage)
        problems = _missing_or_resized(manifest, listing) if check_files else []
        if problems:
            raise CheckpointCorruptError(
                f"{uri}: files do not match the manifest: " + "; ".join(text for _, text in problems),
                path=f"{uri}/{problems[0][0]}",
            )
    metadata, blob = _read_metadata(storage, manifest, verify=verify, listed_size=listing.get(METADATA_NAME))

    from ckptlib.format.native.structure import structure_problems

    errors = [p for p in structure_problems(metadata, manifest, listing, exhaustive=False) if p.is_error]
    if errors:
        cls = UnsafeCheckpointError if any(p.kind == "unsafe" for p in errors) else CheckpointCorruptError
        errors.sort(key=lambda p: p.kind != "unsafe")
        shown = "; ".join(p.text() for p in errors[:5]) + (
            f" ... ({len(errors)} problems in all)" if len(errors) > 5 else ""
        )
        raise cls(
            f"{uri}: {METADATA_NAME} does not match the checkpoint's files: {shown}",
            path=f"{uri}/{errors[0].file or METADATA_NAME}",
        )
    kind = "ckptlib" if manifest else "dcp"
    return CheckpointInfo(uri, kind, manifest, metadata, raw=(manifest_blob, blob, manifest, metadata))


def prepare_save_target(storage: Storage, *, overwrite: bool, world_size: int) -> None:
    """Make `storage` ready for a new save without ever losing a committed checkpoint or a
    file ckptlib did not write.

    Debris of a crashed save is removed; `overwrite=True` also replaces a committed ckptlib
    or plain DCP checkpoint. Only a checkpoint's own files are removed, and only when the
    directory holds nothing else: anything else there (a manager root, a user's files,
    sub-directories) is OverwriteRefusedError and nothing is touched.
    """
    from ckptlib.format.native.deletion import refuse_foreign, remove_checkpoint

    uri = storage.uri
    exists = storage.exists()  # asked once: on S3 each ask is a LIST request
    listing = storage.list() if exists else {}
    kind = classify(storage, listing) if exists else "missing"
    if kind == "committed" and not overwrite:
        raise CheckpointExistsError(f"{uri} already holds a committed checkpoint (pass overwrite=True)", path=uri)
    if kind == "dcp" and not overwrite:
        raise CheckpointExistsError(f"{uri} already holds a DCP checkpoint (pass overwrite=True)", path=uri)
    if kind in ("committed", "incomplete", "dcp", "other"):
        refuse_foreign(
            storage, listing, "overwrite it" if overwrite else "write a checkpoint into it", checkpoint=kind != "other"
        )
        remove_checkpoint(storage, listing)  # debris of a crashed save, or an explicit overwrite
    # Not durable: losing it in a crash is harmless (shards without a manifest are debris anyway).
    storage.write(PENDING_NAME, json.dumps({"world_size": world_size}).encode(), durable=False)


def commit_manifest(
    storage: Storage,
    files: dict[str, FileRecord],
    *,
    world_size: int,
    step: int | None,
    metadata: dict[str, Any],
    metrics: dict[str, Any] | None = None,
    synced: tuple[str, ...] = (),
) -> Manifest:
    """Build the manifest of the files just written (stamped with this torch's and ckptlib's
    versions) and `commit` it; every save and conversion commits through here. `synced`: files
    already durable (see `commit`)."""
    manifest = Manifest(
        world_size=world_size,
        files=dict(files),
        step=step,
        metadata=metadata,
        metrics=dict(metrics or {}),
        torch_version=_torch_version(),
        ckptlib_version=__version__,
    )
    commit(storage, manifest, synced=synced)
    return manifest


def commit(storage: Storage, manifest: Manifest, *, synced: tuple[str, ...] = ()) -> None:
    """Publish the manifest after confirming that every rank's files exist with their sizes
    and making them durable (one directory fsync for all of them, locally). `.metadata` is
    fsynced here unless `synced` names it (written through `open_writer`, which fsyncs)."""
    listing = storage.list()
    problems = _missing_or_resized(manifest, listing)
    if problems:
        raise CheckpointCorruptError(
            f"{storage.uri}: refusing to commit, " + "; ".join(text for _, text in problems), path=storage.uri
        )
    # Every file and name durable before the manifest is: the shards' bytes were fsynced by
    # their writers (open_writer); `.metadata` was written without (CkptWriter.finish).
    unsynced = [METADATA_NAME] if METADATA_NAME in manifest.files and METADATA_NAME not in synced else []
    storage.sync(unsynced, names_only=sorted(set(manifest.files) - set(unsynced)))
    storage.write(MANIFEST_NAME, manifest.to_bytes())
    storage.delete([PENDING_NAME])


def _torch_version() -> str:
    import torch

    return torch.__version__


def _safe_loads(blob: bytes, where: str) -> Any:
    """`safe_pickle.safe_loads`, imported on first use (it needs torch: a root is scanned without)."""
    from ckptlib.format.native.safe_pickle import safe_loads

    return safe_loads(blob, where)
