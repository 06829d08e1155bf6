"""Hugging Face's sharded file layout, shared by the safetensors and torch.save writers: which
tensors go in which shard file, the files' names and index, written atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from ckptlib.errors import StorageError
from ckptlib.storage.local import os_error

if TYPE_CHECKING:
    from ckptlib.format.streaming import SourceValues

# Marks a single-file export as ckptlib's (a safetensors __metadata__ key, a torch archive
# record), so that overwriting it with force=True never replaces a file someone else wrote.
EXPORT_MARK = "ckptlib_export"


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: `cast` applies to floating-point tensors only
    (integer and bool tensors, like optimizer step counts, keep theirs)."""
    return cast if cast is not None and dtype.is_floating_point else dtype


@dataclasses.dataclass
class ShardEntry:
    name: str  # the name written
    fqn: str  # the source key
    dtype: torch.dtype  # as written
    shape: tuple[int, ...]
    nbytes: int  # as written


def planned_entries(source: SourceValues, names: dict[str, str], cast: torch.dtype | None) -> list[ShardEntry]:
    out = []
    for name, fqn in names.items():
        md = source.tensor_meta(fqn)
        dtype = out_dtype(md.properties.dtype, cast)
        shape = tuple(md.size)
        out.append(ShardEntry(name, fqn, dtype, shape, math.prod(shape) * element_size(dtype)))
    return out


def shard_groups(entries: list, max_shard_bytes: int | None) -> list[list]:
    """Split entries (in order) into shards of at most `max_shard_bytes` each, as Hugging
    Face does: a tensor larger than the limit gets a shard of its own."""
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        if max_shard_bytes and groups[-1] and size + entry.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += entry.nbytes
    return groups


def shard_names(stem: str, ext: str, count: int, single: str | None) -> list[str]:
    if count == 1:
        return [single or f"{stem}.{ext}"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def write_index(directory: str, name: str, files: list[str], groups: list[list]) -> None:
    """Hugging Face's shard index: total tensor bytes and parameters (elements of the tensors
    written, as transformers counts `num_parameters()`: a tied weight once), and the file of
    every tensor."""
    entries = [e for group in groups for e in group]
    index = {
        "metadata": {
            "total_parameters": sum(math.prod(e.shape) for e in entries),
            "total_size": sum(e.nbytes for e in entries),
        },
        "weight_map": {e.name: file for file, group in zip(files, groups) for e in group},
    }
    final = os.path.join(directory, name)
    with open(final + ".tmp", "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(final + ".tmp", final)


def write_shards(
    directory: str,
    entries: list[ShardEntry],
    stem: str,
    ext: str,
    write_file: Callable[[str, list[ShardEntry]], None],
    *,
    single_file: str | None,
    max_shard_bytes: int | None,
    on_file: Callable[[str], None] | None,
) -> list[str]:
    """Hugging Face's layout of `entries`: `<stem>.<ext>` (or `single_file`), or shards of at
    most `max_shard_bytes` plus `<stem>.<ext>.index.json`. `write_file(tmp, group)` writes one
    file's tensors, durably, to a temporary name renamed into place; `on_file(name)` is called
    before each file is started. Returns the file names written."""
    groups = shard_groups(entries, max_shard_bytes)
    files = shard_names(stem, ext, len(groups), single_file)
    os.makedirs(directory, exist_ok=True)
    written = []
    for file, group in zip(files, groups):
        if on_file is not None:
            on_file(file)
        with atomic_file(os.path.join(directory, file)) as tmp:
            write_file(tmp, group)
        written.append(file)
    if len(groups) > 1:
        index = f"{stem}.{ext}.index.json"
        if on_file is not None:
            on_file(index)
        write_index(directory, index, files, groups)
        written.append(index)
    return written


# What torch's zip writer says when a write fails: it raises RuntimeError and drops the errno.
_TORCH_WRITE_FAILURES = ("iostream error", "requested and", "failed writing", "PytorchStreamWriter")
_NEARLY_FULL = 1 << 20  # bytes free below which a failed write is reported as a full disk


def write_failed(exc: BaseException, path: str) -> BaseException:
    """The named error for a failed write of `path` (StorageError naming it, "no space left on
    device" for ENOSPC, or for torch's writer failing on a filesystem left nearly full), or
    `exc` itself when it is no write failure."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return os_error(exc, "cannot write", path)
    if not isinstance(exc, (OSError, RuntimeError)) or not any(text in str(exc) for text in _TORCH_WRITE_FAILURES):
        return exc
    try:
        full = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free < _NEARLY_FULL
    except OSError:
        full = False
    if full or "requested and" in str(exc):  # a short write: the file system took fewer bytes than given
        return StorageError(f"cannot write {path}: no space left on device (torch's writer: {exc})", path=path)
    return StorageError(f"cannot write {path}: torch's writer failed ({exc})", path=path)


@contextlib.contextmanager
def atomic_file(final: str) -> Iterator[str]:
    """A temporary path beside `final`, renamed onto it when the block succeeds; a failed write
    (a full disk) is a StorageError naming `final`, and the temporary file is removed."""
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, final)
    except (OSError, RuntimeError) as exc:
        error = write_failed(exc, final)
        if error is exc:
            raise
        raise error from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_CAST_PIECE = 1 << 24  # elements cast at a time while writing, so a cast never holds a second full copy


def write_tensor_bytes(f, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    flat = tensor.reshape(-1)
    if flat.dtype == dtype:
        f.write(memoryview(flat.view(torch.uint8).numpy()))
        return
    for piece in flat.split(_CAST_PIECE):
        f.write(memoryview(piece.to(dtype).view(torch.uint8).numpy()))
