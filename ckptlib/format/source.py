"""The one entry point of every load: detect what a source is and open a DCP reader for it,
native (ckptlib, plain DCP) and foreign (torch.save, v0, safetensors) alike.

Formats (``detect_format`` returns one of these names):

``ckptlib``
    A directory committed by ``ckptlib.save`` (``ckptlib.json`` manifest, item checksums).
``dcp``
    A plain ``torch.distributed.checkpoint`` directory (``.metadata`` + ``__{r}_{i}.distcp``)
    written by any torch since 2.0, ShardedTensor- or DTensor-based. No checksums.
``torch_save``
    One monolithic ``torch.save`` file holding a *full* (unsharded) state dict: either a
    model state dict (a mapping whose values are all tensors, e.g. ``pytorch_model.bin``),
    which is placed under ``prefix`` (default ``"model"``), or a nested mapping such as
    ``{"model": {...}, "optim": {"state": {fqn: {...}}, "param_groups": [...]}}`` (what
    ``dcp_to_torch_save`` and ``ckptlib.convert(..., to="torch")`` write), keyed as is.
    Optimizer state must be keyed by parameter FQN (``get_optimizer_state_dict``); a raw
    ``optimizer.state_dict()`` keyed by integer ids loads nothing silently: its keys do not
    match, so a strict load raises MissingKeysError. Point at the file, or at a directory
    holding exactly one ``*.pt``/``*.pth``/``*.bin``/``*.ckpt`` file.
``v0``
    The per-rank format older trainers wrote (see ``ckptlib.format.foreign.v0.V0_FORMAT``).
``safetensors``
    ``model.safetensors`` (or any single ``*.safetensors`` file), or shards listed by
    ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``). Keys are flat
    parameter FQNs; they are placed under ``prefix`` (default ``"model"``), so
    ``proj.weight`` loads as the ``"model"`` entry's ``proj.weight``.

Every reader is a DCP ``StorageReader`` whose ``Metadata`` describes the source's tensors
as chunks, so ``dcp.load``'s planner reshards them onto any world size and any placement.
Each rank reads only the chunks its plan names: ``torch.save`` and v0 files are opened with
``torch.load(mmap=True, weights_only=True)`` (pages are touched only where a rank copies),
safetensors shards with ranged reads of just the rows a rank needs.

Keys: sources are flattened with DCP's own rules (``_torch.dcp_shims.flatten_state_dict``) and the
original nesting is kept in ``Metadata.planner_data``, exactly like a DCP save, so a
nested state loads by the same keys, and conversions can rebuild the nesting.
"""

from __future__ import annotations

import io
import os
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptlib.errors import CheckpointCorruptError, CheckpointIncompleteError, NotACheckpointError, StorageError
from ckptlib.format.foreign import safetensors, torch_save, v0
from ckptlib.format.foreign.foreign import DEFAULT_PREFIX, SourceFiles, SourceInfo, TensorLoc, file_head, file_size
from ckptlib.format.foreign.safetensors import SAFETENSORS_FILE, SAFETENSORS_INDEX, looks_like_safetensors
from ckptlib.format.foreign.torch_save import TORCH_SAVE_SUFFIXES, looks_like_torch_save
from ckptlib.format.foreign.v0 import V0_FORMAT, V0_RE, v0_rank
from ckptlib.format.native.layout import CheckpointInfo, classify, not_a_checkpoint_error, open_checkpoint
from ckptlib.format.native.stream_transforms import Transforms
from ckptlib.format.read.copies import Copies
from ckptlib.format.read.dcp_reader import CkptReader
from ckptlib.format.read.planned_reader import PlannedReader
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage, list_top, root_is_file
from ckptlib.storage.local import LocalStorage

FORMATS = ("ckptlib", "dcp", "torch_save", "v0", "safetensors")


def _split_file(storage: Storage) -> tuple[Storage, str]:
    """(the directory holding it, its name) for a storage rooted at a local file."""
    path = storage.local_path()
    assert path is not None
    parent, name = os.path.split(path)
    return LocalStorage(parent, fsync=False), name


def _not_a_checkpoint(uri: str, listing: Iterable[str] = ()) -> NotACheckpointError:
    shown = sorted(listing)
    found = (", found: " + ", ".join(shown[:10]) + (" ..." if len(shown) > 10 else "")) if shown else ""
    return NotACheckpointError(
        f"{uri} is not a checkpoint in any format ckptlib reads (ckptlib, DCP .metadata, a torch.save "
        f"file, v0 rank_<r>.pt files, safetensors){found}",
        path=uri,
    )


def _detect(storage: Storage) -> tuple[str, SourceFiles]:
    uri = storage.uri
    if root_is_file(storage):
        root, name = _split_file(storage)
        size = file_size(root, name) or 0
        head = file_head(root, name, size)
        if name.endswith(".index.json"):
            return "safetensors", SourceFiles(root, (name,))
        if name.endswith(".safetensors") or looks_like_safetensors(head, size):
            return "safetensors", SourceFiles(root, (name,))
        if V0_RE.match(name) and looks_like_torch_save(head):
            raise NotACheckpointError(
                f"{uri} looks like one rank's file of a v0 per-rank checkpoint; pass the directory "
                "that holds all rank_<r>.pt files",
                path=uri,
            )
        if looks_like_torch_save(head):
            return "torch_save", SourceFiles(root, (name,))
        raise _not_a_checkpoint(uri)
    if not storage.exists():
        raise not_a_checkpoint_error(storage, "missing")  # absent, or a FIFO or device
    listing = list_top(storage)  # every format's files lie directly in it: never walk a tree below
    kind = classify(storage, listing)
    if kind == "committed":
        return "ckptlib", SourceFiles(storage, ())
    if kind == "dcp":
        return "dcp", SourceFiles(storage, ())
    if kind == "incomplete":
        open_checkpoint(storage)  # raises CheckpointIncompleteError with its usual message
        raise CheckpointIncompleteError(f"{uri} is an uncommitted checkpoint", path=uri)  # pragma: no cover
    top = {name: size for name, size in listing.items() if "/" not in name}
    if SAFETENSORS_INDEX in top:
        return "safetensors", SourceFiles(storage, (SAFETENSORS_INDEX,))
    if SAFETENSORS_FILE in top:
        return "safetensors", SourceFiles(storage, (SAFETENSORS_FILE,))
    indexes = [n for n in top if n.endswith(".safetensors.index.json")]
    singles = [n for n in top if n.endswith(".safetensors")]
    if len(indexes) == 1:
        return "safetensors", SourceFiles(storage, (indexes[0],))
    if not indexes and len(singles) == 1:
        return "safetensors", SourceFiles(storage, (singles[0],))
    ranks = sorted((n for n in top if V0_RE.match(n)), key=v0_rank)
    if ranks:
        return "v0", SourceFiles(storage, tuple(ranks))
    saves = [n for n in top if n.endswith(TORCH_SAVE_SUFFIXES) and looks_like_torch_save(file_head(storage, n, top[n]))]
    if len(saves) == 1:
        return "torch_save", SourceFiles(storage, (saves[0],))
    if len(saves) > 1 or len(indexes) > 1 or len(singles) > 1:
        many = saves if len(saves) > 1 else (indexes if len(indexes) > 1 else singles)
        raise NotACheckpointError(
            f"{uri} holds several candidate checkpoint files ({', '.join(sorted(many))}); pass one file",
            path=uri,
        )
    raise _not_a_checkpoint(uri, top)


def detect_format(uri: Storage | str | os.PathLike) -> str:
    """The format of the checkpoint at `uri`: one of FORMATS.

    Raises CheckpointNotFoundError (no such path), CheckpointIncompleteError (a ckptlib or DCP
    save that never finished) or NotACheckpointError (anything else), each naming the path.
    """
    return _detect(as_storage(uri))[0]


class ForeignReader(PlannedReader):
    """Serves DCP read items from a torch_save, v0 or safetensors source (see SourceInfo)."""

    def __init__(self, root: Storage, info: SourceInfo, *, trusted: bool = False):
        super().__init__(info.metadata)
        self.root = root
        self.info = info
        self.trusted = trusted
        self._opened: dict[str, Any] = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_opened"] = {}  # mmapped files are reopened where the reader lands
        return state

    def reset(self, checkpoint_id=None) -> None:
        self._opened = {}

    def _open(self, name: str) -> Any:
        if name not in self._opened:
            self._opened[name] = torch_save.torch_load(self.root, name, trusted=self.trusted)
        return self._opened[name]

    def _piece(self, loc: Any, offsets: torch.Size, lengths: torch.Size, fqn: str) -> torch.Tensor:
        if isinstance(loc, TensorLoc):
            value, nbytes = torch_save.read_piece(self.root, self._open, loc, offsets, lengths, fqn)
        else:
            value, nbytes = safetensors.read_piece(self.root, loc, offsets, lengths)
        self.bytes_read += nbytes
        return value

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        try:
            for req in plan.items:
                loc = self.storage_data[req.storage_index]
                fqn = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(loc.value, buf)
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                piece = self._piece(loc, req.storage_offsets, req.lengths, fqn)
                target = planner.resolve_tensor(req).detach()
                if target.size() != piece.size():
                    raise CheckpointCorruptError(
                        f"{self.info.uri}: {fqn}: stored piece has shape {tuple(piece.size())}, "
                        f"expected {tuple(target.size())}",
                        path=self.info.uri,
                    )
                target.copy_(piece)
                planner.commit_tensor(req, target)
        finally:
            self._opened = {}  # drop the mappings: touched pages are released with them
        fut: Future = Future()
        fut.set_result(None)
        return fut


def inspect_checkpoint(
    storage_or_path: Storage | str | os.PathLike,
    *,
    verify: bool = True,
    prefix: str | None = DEFAULT_PREFIX,
    trusted: bool = False,
) -> CheckpointInfo:
    """Detect the format at `storage_or_path` and describe it (run on one rank, broadcast the result).

    ckptlib and plain DCP directories give `open_checkpoint`'s CheckpointInfo (kind "ckptlib"
    or "dcp"); the other formats a SourceInfo whose kind is the format name.
    """
    storage = as_storage(storage_or_path)
    fmt, where_ = _detect(storage)
    if fmt in ("ckptlib", "dcp"):
        return open_checkpoint(storage, verify=verify)
    if fmt == "torch_save":
        info = torch_save.inspect(where_, storage.uri, prefix=prefix, trusted=trusted)
    elif fmt == "v0":
        info = v0.inspect(where_, storage.uri, trusted=trusted)
    else:
        info = safetensors.inspect(where_, storage.uri, prefix=prefix)
    if where_.root is not storage:
        info.file_root = where_.root.uri
    return info


def open_reader(
    storage_or_path: Storage | str | os.PathLike,
    *,
    info: CheckpointInfo | None = None,
    verify: bool = True,
    prefix: str | None = DEFAULT_PREFIX,
    trusted: bool = False,
    copies: Copies | None = None,
    transforms: Transforms | None = None,
) -> tuple[StorageReader, CheckpointInfo]:
    """A DCP StorageReader for any format `detect_format` knows, and what the checkpoint is.

    Pass `info` (from `inspect_checkpoint` on rank 0, broadcast) to skip inspecting again:
    building a reader from it does no I/O. `verify` applies to ckptlib checkpoints (item
    checksums); `trusted` lets torch.save/v0 files unpickle arbitrary objects (and the
    native reader hand objects to a planner that does not unpickle them safely itself).
    `copies`: where a ckptlib or DCP checkpoint's files are read from (`copies`; default:
    `storage_or_path`). `transforms` knows the DCP extensions items may be stored with
    (default: zstd), and any other found is UnsupportedError here, before anything is read.
    """
    storage = as_storage(storage_or_path)
    if info is None:
        info = inspect_checkpoint(storage, verify=verify, prefix=prefix, trusted=trusted)
    if not isinstance(info, SourceInfo):
        if root_is_file(storage) and copies is None:
            raise NotACheckpointError(f"{storage.uri} is a file, not a checkpoint directory", path=storage.uri)
        transforms = transforms or Transforms()
        transforms.check_readable(info.metadata.storage_data.values(), storage.uri)  # before anything is read
        reader = CkptReader(
            storage, info.metadata, info.manifest, verify=verify, copies=copies, trusted=trusted, transforms=transforms
        )
        return reader, info
    if copies is not None:
        raise NotACheckpointError(
            f"{storage.uri}: copies= reads ckptlib and DCP checkpoints, not {info.kind} files", path=storage.uri
        )
    root = storage
    if info.file_root is not None:
        if not root_is_file(storage):
            raise StorageError(f"{storage.uri}: expected the file this checkpoint info was made from", path=storage.uri)
        root, _ = _split_file(storage)
    return ForeignReader(root, info, trusted=trusted), info


__all__ = [
    "DEFAULT_PREFIX",
    "FORMATS",
    "ForeignReader",
    "SourceInfo",
    "V0_FORMAT",
    "detect_format",
    "inspect_checkpoint",
    "open_reader",
]
