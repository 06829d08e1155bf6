"""ckptlib's exceptions: one base class, one subclass per failure a caller can act on.

Every error is picklable (it crosses process boundaries when one rank's failure is
re-raised on all ranks) and names the path, key or rank it is about.
"""

from __future__ import annotations

import os
import sys
import warnings


class CheckpointError(Exception):
    """Base class of every error ckptlib raises on purpose. Its message and path never carry a
    credential (a URL's password, a signature, a key or token: `storage.scrub.scrub_message`),
    whichever backend or path the text came from."""

    def __init__(self, message: str, *, path: str | None = None, rank: int | None = None):
        message = _scrubbed(message)
        super().__init__(message)
        self.message = message
        self.path = _scrubbed(path) if isinstance(path, str) else path
        self.rank = rank

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))

    def __str__(self) -> str:
        return self.message


def _scrubbed(text: str) -> str:
    from ckptlib._scrub import scrub_message  # imported on use: the storage package imports this module

    return scrub_message(text) if isinstance(text, str) else text


def _rebuild(cls, message, state):
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class CheckpointNotFoundError(CheckpointError):
    """The path does not exist."""


class CheckpointRemovedError(CheckpointNotFoundError):
    """The checkpoint (a manager's step) was deleted while it was being loaded, by another
    process's retention or gc: gone, not damaged. `step` names the step."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.step = step


class NotACheckpointError(CheckpointError):
    """The path exists but holds no checkpoint (no manifest, no DCP metadata)."""


class CheckpointIncompleteError(CheckpointError):
    """A ckptlib save started here but never committed (crashed or still running)."""


class CheckpointCorruptError(CheckpointError):
    """Committed files do not match the manifest (size, checksum, missing file)."""


class NotARegularFileError(CheckpointCorruptError):
    """A checkpoint file (or the `latest` pointer) is a FIFO, a device, a socket or a directory:
    ckptlib reads only regular files and symlinks to them, so a crafted name can never make a
    read block forever (a FIFO) or never end (/dev/zero)."""


class CopiesExhaustedError(CheckpointCorruptError):
    """Every copy of a checkpoint file that a load tried (its own node's, a peer's replica, the
    remote: `ckptlib.format.read.copies`) is missing, short or damaged. `file` is the file's name;
    `tried` lists (label, uri, problem) for each copy tried, across every rank that tried one."""

    def __init__(self, message: str, *, file: str, tried=(), path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.file = file
        self.tried = [tuple(t) for t in tried]


class DamagedCopyError(CheckpointCorruptError):
    """A node's copy of a checkpoint file read for an upload is missing or does not match its
    manifest. `file` names the file, `rank` the rank that read it. The cluster tier sets the
    copy aside (`<file>.damaged`) and uploads the file from another node's copy; this error is
    raised only when no other copy is left."""

    def __init__(self, message: str, *, file: str, path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.file = file


class CopiesMissingError(CopiesExhaustedError, CheckpointNotFoundError):
    """CopiesExhaustedError where no copy tried holds the file at all (none is damaged)."""


class NoCopyError(CheckpointNotFoundError):
    """No rank of a load holds a copy of a file that some rank needs (`ckptlib.format.read.copies`):
    names the file and the ranks that need it."""


class CopyFallbackWarning(UserWarning):
    """A copy of a checkpoint file was missing, short or damaged; the load read the file's items
    from the next copy (both named)."""


class CheckpointExistsError(CheckpointError):
    """Refusing to overwrite a committed checkpoint."""


class OverwriteRefusedError(CheckpointExistsError, NotACheckpointError):
    """An overwrite (or a cleanup) target exists but is not only a checkpoint: a manager root,
    a directory with files ckptlib did not write, a file it does not recognise. Nothing was
    touched. Both "something is there" and "it is not a checkpoint ckptlib may replace"."""


class MissingKeysError(CheckpointError):
    """Keys the caller asked for are not in the checkpoint (strict load): `.keys`; `.unused`:
    the checkpoint's keys the state did not ask for (a renamed layer shows up in both)."""

    def __init__(self, message: str, *, keys=(), unused=(), path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.keys = list(keys)
        self.unused = list(unused)


class UnusedKeysError(CheckpointError):
    """The checkpoint holds keys no rank's state asks for (a load with allow_unused=False)."""

    def __init__(self, message: str, *, keys=(), path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.keys = list(keys)


class ShapeMismatchError(CheckpointError):
    """A tensor's shape or dtype differs between the caller's state and the checkpoint."""

    def __init__(self, message: str, *, keys=(), path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.keys = list(keys)


class DtypeMismatchError(ShapeMismatchError):
    """A tensor's dtype differs between the caller's state and the checkpoint and the load did
    not opt in to converting it (`cast=True`). `casts` maps each key to (saved, requested)."""

    def __init__(self, message: str, *, keys=(), casts=None, path: str | None = None, rank: int | None = None):
        super().__init__(message, keys=keys, path=path, rank=rank)
        self.casts = dict(casts or {})


class CastWarning(UserWarning):
    """A load with `cast=True` converted tensors to the dtype the state asked for (keys listed)."""


class UnsafeCheckpointError(CheckpointError):
    """Metadata or an object would need code execution (a pickle global outside the allowlist),
    or a file name in the manifest/metadata escapes the checkpoint directory."""


class StateError(CheckpointError):
    """The state passed to save/load cannot be turned into a state dict (bad key or value)."""


class RanksDisagreeError(StateError):
    """The ranks of a collective save or load passed what must be the same on every rank but
    is not: the step, or a key's kind, dtype or shape (`keys`; ["step"] for the step). Raised
    on every rank, before anything is written; `ranks` are the ranks involved."""

    def __init__(self, message: str, *, ranks=(), keys=(), path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.ranks = list(ranks)
        self.keys = list(keys)


class NotCalledByEveryRankError(RanksDisagreeError):
    """A collective save or load that some ranks never called (a save on rank 0 only): raised
    on the ranks that did, once `CKPTLIB_CALL_GRACE` (or the process group's timeout) ran out,
    naming the ranks that are alive but did not take part (`ranks`); and at once on a rank
    that makes the call after the others gave up on it (`ranks`: those they waited for)."""


class ProcessGroupError(StateError):
    """A collective call's process group is not part of this process's torch.distributed world:
    destroyed, or made before `destroy_process_group()` (a CheckpointManager keeps the group it
    was made with); or a group passed while no world is initialized. Raised before any collective."""


class StorageError(CheckpointError):
    """The storage backend failed permanently (permission denied, bucket missing, retries exhausted)."""


class LocalLimitError(StorageError):
    """A save would take a node's root past `Cluster(max_local_bytes=...)` or past its
    filesystem's free space (the in-memory tier's bound); refused before anything was written.
    `node`, `held`, `need` and `limit` are the figures of the node that refused."""

    def __init__(self, message: str, *, path=None, rank=None, node=None, held=None, need=None, limit=None):
        super().__init__(message, path=path, rank=rank)
        self.node, self.held, self.need, self.limit = node, held, need, limit


class RankLostError(CheckpointError):
    """A peer rank disappeared (its process died or its connection broke) during a collective
    save or load; `ranks` are those that did not answer, `step` the step being saved or loaded."""

    def __init__(
        self, message: str, *, ranks=(), step: int | None = None, path: str | None = None, rank: int | None = None
    ):
        super().__init__(message, path=path, rank=rank)
        self.ranks = list(ranks)
        self.step = step


class RemoteUnavailableError(StorageError):
    """The cluster tier's remote root could not be read while no node held a local step: whether
    a committed step exists is unknown, so resuming nothing could retrain and then overwrite
    it. `path` names the remote; `load(..., fresh_start_ok=True)` starts from scratch anyway."""


class RankInterruptedError(CheckpointError):
    """Another rank was interrupted (Ctrl-C, `sys.exit`) during a collective save or load; it
    re-raised its KeyboardInterrupt or SystemExit itself. `ranks` names the interrupted ranks;
    what was being saved is cleaned up as after any failure."""

    def __init__(self, message: str, *, ranks=(), path: str | None = None, rank: int | None = None):
        super().__init__(message, path=path, rank=rank)
        self.ranks = list(ranks)


class UploadError(StorageError):
    """Uploading a step to a tiered manager's remote root failed; the remote `latest` was not moved."""


class RemoteLagError(UploadError):
    """The remote has been unreachable for longer than `Cluster(remote_lag=RemoteLag(...))`
    allows (steps not uploaded, or seconds since the oldest of them), or still lacks the newest
    step when `close()` tried it (no later save will): names the remote, the steps and the last
    failure. Every step stays committed locally."""


class UploadRankLostError(UploadError, RankLostError):
    """A rank disappeared while the ranks uploaded a step (a node killed mid-upload): both an
    UploadError (the remote `latest` was not moved) and a RankLostError (`ranks` names them)."""


class ReplicationError(StorageError):
    """Copying a node's files to its partner node failed (a replica that does not match the
    manifest, a partner's disk full); the replica was removed, the local checkpoint stays."""


class ReplicationRankLostError(ReplicationError, RankLostError):
    """A rank disappeared while the nodes exchanged replicas (a partner node down)."""


class UnsupportedError(CheckpointError):
    """The installed torch lacks a feature this call needs (see ckptlib._torch)."""


class LockedError(CheckpointError):
    """Another writer holds the checkpoint root."""


class WriterProcessError(CheckpointError):
    """The writer process of an async save with async_mode="process" died (or never became
    ready) while it wrote this rank's shard; the save failed and the next one starts a new one."""


class StagingCapError(StateError):
    """An async save with `AsyncMode(max_staging_bytes=N)` holds a tensor larger than N: it
    cannot be staged in pieces of at most N bytes. Raised on every rank before anything is
    written; `key` is the tensor's, `nbytes` its size (this rank's shard) and `cap` N."""

    def __init__(self, message: str, *, key=None, nbytes=None, cap=None, path=None, rank=None):
        super().__init__(message, path=path, rank=rank)
        self.key, self.nbytes, self.cap = key, nbytes, cap


def stacklevel_outside_ckptlib() -> int:
    """warnings.warn's stacklevel, for a warning its caller raises, that names the first frame
    outside ckptlib: the user's line that called ckptlib (directly, or through a
    CheckpointManager), however many of ckptlib's frames (collective rounds, the manager, the
    lock) lie in between."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_scrubbed(message: str, category: type[Warning]) -> None:
    """warnings.warn for a warning that quotes an error (a storage backend's may carry an
    endpoint's password or a signed URL): its message scrubbed like every CheckpointError's,
    naming the first frame outside ckptlib."""
    warnings.warn(_scrubbed(message), category, stacklevel=stacklevel_outside_ckptlib())
