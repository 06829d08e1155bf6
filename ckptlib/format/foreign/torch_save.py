"""torch.save files: one monolithic file holding a full (unsharded) state dict, read as a DCP
source (memory-mapped, weights_only unless trusted) and written from any source, tensor by
tensor (see `streaming` for the memory bounds)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ckptlib._torch import dcp_shims
from ckptlib.errors import CheckpointCorruptError, CheckpointError, NotACheckpointError, UnsafeCheckpointError
from ckptlib.format.foreign.foreign import (
    ObjectLoc,
    SourceFiles,
    SourceInfo,
    TensorLoc,
    check_plain_tensor,
    new_metadata,
    tensor_metadata,
)
from ckptlib.format.foreign.shard_files import EXPORT_MARK, ShardEntry, planned_entries, write_shards
from ckptlib.format.foreign.torch_archive import TorchArchiveWriter, streaming_torch_save_reason
from ckptlib.storage.base import Storage
from ckptlib.storage.local import check_regular

if TYPE_CHECKING:
    from ckptlib.format.streaming import SourceValues

TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"  # pickled torch magic number (pre-1.6 files)


def looks_like_torch_save(head: bytes) -> bool:
    return head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_TORCH_MAGIC)


def memory_mapped(root: Storage, name: str) -> bool:
    """Whether `torch_load` memory-maps file `name` (a local zip-format torch.save file: a piece
    of it costs just the pages copied), rather than reading it whole into memory."""
    path = root.local_path(name)
    if path is None or not os.path.isfile(path):  # never open a FIFO or a device
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    except OSError:
        return False


def torch_load(root: Storage, name: str, *, trusted: bool, notes: list[str] | None = None) -> Any:
    """torch.load a file memory-mapped (local) or from its bytes (remote), weights_only unless trusted."""
    where = f"{root.uri}/{name}"
    path = root.local_path(name)
    try:
        if path is not None:
            check_regular(path)  # never mmap or read a FIFO or device
            try:
                return torch.load(path, map_location="cpu", mmap=True, weights_only=not trusted)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                if notes is not None:
                    notes.append(f"{where}: legacy (pre-zip) torch.save format, read into memory (no mmap)")
                return torch.load(path, map_location="cpu", weights_only=not trusted)
        if notes is not None:
            notes.append(f"{where}: not a local file, read whole into memory")
        return torch.load(io.BytesIO(root.read(name)), map_location="cpu", weights_only=not trusted)
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{where} is missing", path=where) from exc
    except CheckpointError:
        raise
    except Exception as exc:
        if type(exc).__name__ == "UnpicklingError" or "Weights only load failed" in str(exc):
            raise UnsafeCheckpointError(
                f"{where}: torch.load(weights_only=True) refused it ({str(exc).splitlines()[0]}); "
                "pass trusted=True only if you trust this file's author",
                path=where,
            ) from exc
        raise CheckpointCorruptError(
            f"{where}: cannot be read by torch.load ({type(exc).__name__}: {exc})", path=where
        ) from exc


def _is_model_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def inspect(where_: SourceFiles, uri: str, *, prefix: str | None, trusted: bool) -> SourceInfo:
    root, name = where_.root, where_.names[0]
    where = f"{root.uri}/{name}"
    notes: list[str] = []
    obj = torch_load(root, name, trusted=trusted, notes=notes)
    if not isinstance(obj, dict):
        raise NotACheckpointError(
            f"{where}: a torch.save file of a {type(obj).__name__}, not a state dict (a mapping)", path=where
        )
    base: tuple = ()
    if _is_model_state_dict(obj) and prefix:
        base = (prefix,)
        notes.append(f"{where}: a flat model state dict, loaded as the {prefix!r} entry")
    sdm: dict = {}
    planner_data: dict = {}
    storage_data: dict = {}
    flat, mappings = dcp_shims.flatten_state_dict({prefix: obj} if base else obj)
    for fqn, value in flat.items():
        path = tuple(mappings[fqn])
        if isinstance(value, torch.Tensor):
            check_plain_tensor(value, where, fqn)
            chunks = [((0,) * value.dim(), tuple(value.shape))] if value.numel() else []
            sdm[fqn] = tensor_metadata(value.dtype, value.shape, chunks)
            for offsets, _ in chunks:
                storage_data[MetadataIndex(fqn, offsets)] = TensorLoc(name, path[len(base) :])
        else:
            sdm[fqn] = BytesStorageMetadata()
            storage_data[MetadataIndex(fqn)] = ObjectLoc(value)
        planner_data[fqn] = path
    return SourceInfo(
        uri=uri,
        kind="torch_save",
        manifest=None,
        metadata=new_metadata(sdm, planner_data, storage_data),
        saved_world_size=None,
        files=(name,),
        notes=notes,
    )


def read_piece(
    root: Storage, opened: Callable[[str], Any], loc: TensorLoc, offsets, lengths, fqn: str
) -> tuple[torch.Tensor, int]:
    """The [offsets, offsets + lengths) piece of a tensor stored whole (torch_save) or of one
    rank's piece (v0), and its size in bytes; `opened(file)` is the file's torch.load result
    (memory-mapped, so only the pages copied from are read)."""
    value: Any = opened(loc.file)
    try:
        for key in loc.path:
            value = value[key]
        if isinstance(value, dict) and "local" in value:
            value = value["local"]
    except (KeyError, IndexError, TypeError) as exc:
        where = f"{root.uri}/{loc.file}"
        raise CheckpointCorruptError(
            f"{where}: {fqn} is no longer in the file (changed since it was opened?)", path=where
        ) from exc
    if not isinstance(value, torch.Tensor):
        where = f"{root.uri}/{loc.file}"
        raise CheckpointCorruptError(f"{where}: {fqn} is not a tensor any more", path=where)
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        value = value.narrow(dim, start, length)
    return value, value.numel() * value.element_size()


def _spill(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """Write a tensor's bytes to `path` and return a tensor mapped from that file."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    flat.view(torch.uint8).numpy().tofile(path)
    mapped = torch.from_file(path, shared=True, size=flat.numel(), dtype=tensor.dtype)
    return mapped.reshape(tensor.shape)


def write_torch_save(path: str, source: SourceValues, *, on_tensor: Callable[[str, int], None] | None = None) -> int:
    """One torch.save file at `path` (written to a temporary name, then renamed) of the full
    state nested as saved; returns its size."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    spill = tempfile.mkdtemp(prefix=".ckptlib-spill-", dir=directory)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        leaves: dict[str, Any] = source.objects()
        for i, fqn in enumerate(source.tensor_keys):
            tensor = source.tensor(fqn)
            leaves[fqn] = _spill(tensor, os.path.join(spill, str(i)))
            del tensor
            if on_tensor is not None:
                on_tensor(fqn, source.nbytes(fqn))
        state = source.nested(leaves)
        del leaves
        torch.save(state, tmp)
        del state
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return os.path.getsize(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        shutil.rmtree(spill, ignore_errors=True)


def _write_torch_archive(path: str, source: SourceValues, group: list[ShardEntry], on_tensor, mark: bool) -> None:
    """One torch.save file of the flat dict {name: tensor} for `group`, one tensor in memory."""
    if streaming_torch_save_reason() is None:
        writer = TorchArchiveWriter(path, [(e.name, e.dtype, e.shape) for e in group])
        try:
            if mark:
                writer.add_record(EXPORT_MARK, "1")
            for e in group:
                tensor = source.tensor(e.fqn).to(e.dtype).contiguous()
                writer.add(tensor)
                del tensor
                if on_tensor is not None:
                    on_tensor(e.fqn, e.nbytes)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        return
    # This torch's archive differs from the streamed one: spill each tensor to a mapped file
    # and let torch.save copy from the mappings (page cache, not anonymous memory).
    spill = tempfile.mkdtemp(prefix=".ckptlib-spill-", dir=os.path.dirname(path))
    try:
        flat = {}
        for i, e in enumerate(group):
            flat[e.name] = _spill(source.tensor(e.fqn).to(e.dtype), os.path.join(spill, str(i)))
            if on_tensor is not None:
                on_tensor(e.fqn, e.nbytes)
        torch.save(flat, path)
    finally:
        shutil.rmtree(spill, ignore_errors=True)


def write_torch_files(
    directory: str,
    source: SourceValues,
    names: dict[str, str],
    *,
    single_file: str | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
    on_file: Callable[[str], None] | None = None,
    mark: bool = False,
) -> list[str]:
    """Hugging Face's torch layout: pytorch_model.bin (or `single_file`), a torch.save of the
    flat dict {name: tensor}, or shards pytorch_model-0000k-of-0000n.bin plus
    pytorch_model.bin.index.json. Written one tensor at a time; returns the file names."""
    entries = planned_entries(source, names, dtype)

    def write_file(tmp: str, group: list[ShardEntry]) -> None:
        _write_torch_archive(tmp, source, group, on_tensor, mark)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())

    return write_shards(
        directory,
        entries,
        "pytorch_model",
        "bin",
        write_file,
        single_file=single_file,
        max_shard_bytes=max_shard_bytes,
        on_file=on_file,
    )
