"""Export a checkpoint as one consolidated model in Hugging Face's layout.

    ckptlib.export("ckpt/run1", "hf/", model_only=True, dtype=torch.bfloat16)
    # hf/model-00001-of-00003.safetensors ... + hf/model.safetensors.index.json
    # (one hf/model.safetensors when everything fits in one shard, as Hugging Face does)

Any source ckptlib reads (ckptlib or plain DCP at any saved world size, torch.save files,
v0 per-rank files, safetensors; a CheckpointManager root exports its `latest` step), in one
process, one tensor in memory at a time: peak memory is about the largest tensor plus a
few tens of MiB, never the checkpoint (the writers live with their readers in
`ckptlib.format.safetensors` and `ckptlib.format.torch_save`).

A directory export records what it wrote in `ckptlib_export.json`, written before the first
weight file and completed after the last: `force=True` replaces only an export ckptlib
wrote (it removes exactly the files that record lists), never a directory of other files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import time
from typing import Any, Callable, Mapping

import torch

from .errors import CheckpointExistsError, CheckpointNotFoundError, NotACheckpointError, StateError, UnsupportedError
from .format.foreign import DEFAULT_PREFIX
from .format.safetensors import write_safetensors
from .format.shard_files import EXPORT_MARK, planned_entries
from .format.source import inspect_checkpoint, open_reader
from .format.streaming import SourceValues
from .format.torch_save import write_torch_files
from .observe import log_operation
from .storage import Storage, as_storage, is_remote, root_is_file

FORMATS = ("safetensors", "torch")
EXPORT_RECORD = "ckptlib_export.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_SINGLE_SUFFIXES = {"safetensors": (".safetensors",), "torch": (".bin", ".pt", ".pth")}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclasses.dataclass
class ExportResult:
    """What an export wrote: `files` in `dst`, `bytes` of tensor data (as written, after the
    dtype cast), the source's step and saved world size, and the tensors left out."""

    src: str
    dst: str
    src_format: str
    format: str
    step: int | None
    world_size: int | None
    dtype: str | None
    tensors: int
    bytes: int
    files: list[str]
    skipped: list[str]
    seconds: float

    @property
    def mib_per_s(self) -> float | None:
        return self.bytes / (1 << 20) / self.seconds if self.seconds > 0 else None


def parse_size(value: int | str | None) -> int | None:
    """Hugging Face's shard sizes: an int (bytes) or "5GB" (10**9), "500MB", "2GiB" (2**30)."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        if value is not None and value < 1:
            raise ValueError(f"max shard size must be positive, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"max shard size must be bytes or like '5GB', '500MB', '2GiB'; got {value!r}")
    unit = (match.group(2) or "B").upper()
    size = int(float(match.group(1)) * _UNITS[unit if unit.endswith("B") else unit + "B"])
    if size < 1:
        raise ValueError(f"max shard size must be positive, got {value!r}")
    return size


def parse_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype such as bfloat16, got {value!r}")
    return dtype


def _source_storage(src: str | os.PathLike | Storage, step: int | None) -> Storage:
    """The checkpoint to export: `src` itself, or a step of the CheckpointManager root `src`
    (`step`, default the one `latest` names)."""
    storage = as_storage(src)
    from .manager import CheckpointManager, step_dir

    manager = CheckpointManager(storage.uri)
    if step is not None:
        if step not in manager.steps():
            raise CheckpointNotFoundError(f"{storage.uri} has no committed step {step}", path=manager.path(step))
        return storage.child(step_dir(step))
    try:
        inspect_checkpoint(storage, verify=False)
        return storage
    except NotACheckpointError:
        latest = manager.latest() if storage.exists() and not root_is_file(storage) else None
        if latest is None:
            raise
        return storage.child(step_dir(latest))


def _as_callable(key_map: Callable[[str], str | None] | Mapping[str, str] | None) -> Callable[[str], str | None] | None:
    """A key map given as {old_prefix: new_prefix} (the longest matching prefix wins) as a callable."""
    if key_map is None or callable(key_map):
        return key_map
    if not isinstance(key_map, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in key_map.items()
    ):
        raise StateError(f"key_map must be a callable or a dict of str prefixes, got {key_map!r}")
    prefixes = sorted(key_map, key=len, reverse=True)

    def rename(name: str) -> str:
        for old in prefixes:
            if name.startswith(old):
                return key_map[old] + name[len(old) :]
        return name

    return rename


def _names(
    tensor_keys: list[str], object_keys: list[str], model_only: bool, key_map: Callable[[str], str | None] | None
) -> tuple[dict[str, str], list[str]]:
    """({written name: source key}, skipped source keys)."""
    prefix = DEFAULT_PREFIX + "."
    names: dict[str, str] = {}
    skipped = list(object_keys)
    for fqn in tensor_keys:
        if model_only and not fqn.startswith(prefix):
            skipped.append(fqn)
            continue
        name: str | None = fqn[len(prefix) :] if model_only else fqn
        if key_map is not None:
            name = key_map(name)
            if name is None:
                skipped.append(fqn)
                continue
            if not isinstance(name, str) or not name:
                raise StateError(f"key_map returned {name!r} for {fqn!r}; expected a non-empty str or None")
        if name in names:
            raise StateError(f"two tensors are exported as {name!r}: {names[name]!r} and {fqn!r} (check key_map)")
        names[name] = fqn
    return names, skipped


def _read_record(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, EXPORT_RECORD), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != "ckptlib-export" or not isinstance(doc.get("files"), list):
        return None
    return doc


def _write_record(directory: str, doc: dict[str, Any]) -> None:
    final = os.path.join(directory, EXPORT_RECORD)
    with open(final + ".tmp", "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + ".tmp", final)


def _clear_directory(path: str, force: bool) -> None:
    """Make `path` an empty or absent directory to export into, or refuse."""
    if os.path.isfile(path):
        raise CheckpointExistsError(f"{path} is a file; exporting writes a directory there", path=path)
    if not os.path.isdir(path) or not os.listdir(path):
        return
    record = _read_record(path)
    if record is None:
        raise CheckpointExistsError(
            f"{path} exists and is not an export ckptlib wrote (no {EXPORT_RECORD}); refusing to write into it"
            + (" even with force" if force else "")
            + ": choose an empty or new directory",
            path=path,
        )
    if not force:
        raise CheckpointExistsError(
            f"{path} already holds an export (pass force=True, or --force, to replace it)", path=path
        )
    for name in record["files"]:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointExistsError(f"{path}/{EXPORT_RECORD} lists an unsafe file name {name!r}", path=path)
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    os.unlink(os.path.join(path, EXPORT_RECORD))


def _single_file_is_export(path: str, fmt: str) -> bool:
    """Whether the file at `path` is a single-file export ckptlib wrote (its embedded mark)."""
    try:
        if fmt == "safetensors":
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, 1 << 24)))
            return header.get("__metadata__", {}).get(EXPORT_MARK) is not None
        import zipfile

        with zipfile.ZipFile(path) as archive:
            return any(n.endswith("/" + EXPORT_MARK) for n in archive.namelist())
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False


def _check_single_file(path: str, fmt: str, force: bool) -> None:
    if os.path.isdir(path):
        raise CheckpointExistsError(f"{path} is a directory; a {fmt} file name was given", path=path)
    if not os.path.exists(path):
        return
    if not _single_file_is_export(path, fmt):
        raise CheckpointExistsError(
            f"{path} exists and is not an export ckptlib wrote; refusing to overwrite it"
            + (" even with force" if force else ""),
            path=path,
        )
    if not force:
        raise CheckpointExistsError(f"{path} already exists (pass force=True, or --force, to overwrite)", path=path)


def export(
    src: str | os.PathLike | Storage,
    dst: str | os.PathLike,
    *,
    format: str = "safetensors",
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    model_only: bool = False,
    key_map: Callable[[str], str | None] | Mapping[str, str] | None = None,
    step: int | None = None,
    force: bool = False,
    progress: bool = False,
    trusted: bool = False,
    verify: bool = True,
) -> ExportResult:
    """Write the checkpoint at `src` as one consolidated model in Hugging Face's layout at `dst`.

    - `format="safetensors"`: `model.safetensors`, or `model-0000k-of-0000n.safetensors` plus
      `model.safetensors.index.json` (`metadata.total_size`, `weight_map`) when the tensors
      exceed `max_shard_size` (bytes, or "5GB"/"500MB"/"2GiB" as Hugging Face spells it; a
      tensor larger than that gets a shard of its own). `format="torch"`: `pytorch_model.bin`
      (torch.save of the flat {name: tensor} dict), or `pytorch_model-0000k-of-0000n.bin`
      plus `pytorch_model.bin.index.json`. A `dst` ending in .safetensors (or .bin/.pt/.pth for
      torch) is one file, never sharded.
    - `model_only=True`: only the tensors of the state's "model" entry, named without the
      "model." prefix (the names `model.state_dict()` has, which is what transformers'
      loaders expect); otherwise every tensor under its full key ("model.w",
      "optim.state.w.exp_avg", ...). Non-tensor values are never exported (listed in
      `skipped`).
    - `dtype` (e.g. torch.bfloat16 or "bfloat16"): floating-point tensors are cast to it;
      integer and bool tensors keep theirs.
    - `key_map(name) -> str | None`: renames each tensor (after the prefix is stripped);
      None leaves it out. A dict {old_prefix: new_prefix} renames by prefix (longest first).
    - `src`: a checkpoint in any format ckptlib reads, or a CheckpointManager root (its
      `latest` step, or `step`).

    Refuses (CheckpointExistsError) to write into an existing `dst` unless `force=True`,
    and even then only when `dst` is an export ckptlib wrote.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    cast = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    started = time.perf_counter()
    if is_remote(dst) or str(dst).startswith("file://"):
        raise UnsupportedError(f"export writes a local directory or file; {dst} is not a local path")
    dst_path = os.fspath(dst)
    single = dst_path.endswith(_SINGLE_SUFFIXES[format])

    source_storage = _source_storage(src, step)
    info = inspect_checkpoint(source_storage, verify=verify, trusted=trusted)
    reader, info = open_reader(source_storage, info=info, verify=verify, trusted=trusted)
    source = SourceValues(reader, info.metadata, trusted=trusted)
    names, skipped = _names(source.tensor_keys, source.object_keys, model_only, _as_callable(key_map))
    if not names:
        shown = ", ".join(source.tensor_keys[:8]) + (" ..." if len(source.tensor_keys) > 8 else "")
        raise StateError(
            f"{info.uri}: no tensors to export"
            + (" under 'model'" if model_only else "")
            + f" (tensors: {shown or 'none'})",
            path=info.uri,
        )
    local_src = source_storage.local_path()
    if local_src is not None:
        a, b = os.path.realpath(local_src), os.path.realpath(dst_path)
        if a == b or b.startswith(a + os.sep) or a.startswith(b + os.sep):
            raise StateError(f"refusing to export {info.uri} into or over itself ({dst_path})", path=dst_path)

    if single:
        _check_single_file(dst_path, format, force)
        directory = os.path.dirname(os.path.abspath(dst_path))
    else:
        _clear_directory(dst_path, force)
        directory = dst_path
    os.makedirs(directory, exist_ok=True)
    record: dict[str, Any] = {
        "format": "ckptlib-export",
        "version": 1,
        "complete": False,
        "source": info.uri,
        "step": info.step,
        "export_format": format,
        "dtype": None if cast is None else str(cast).removeprefix("torch."),
        "model_only": model_only,
        "files": [],
    }

    def on_file(name: str) -> None:
        if not single:
            record["files"].append(name)
            _write_record(directory, record)

    total = sum(e.nbytes for e in planned_entries(source, names, cast))
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"export {format}",
        disable=not progress,
        leave=False,
    )
    write = write_safetensors if format == "safetensors" else write_torch_files
    try:
        files = write(
            directory,
            source,
            names,
            single_file=os.path.basename(dst_path) if single else None,
            max_shard_bytes=None if single else shard_bytes,
            dtype=cast,
            on_tensor=lambda _fqn, nbytes: bar.update(nbytes),
            on_file=on_file,
            mark=single,
        )
    finally:
        bar.close()
    if not single:
        record["complete"] = True
        record["files"] = files
        record["total_size"] = total
        _write_record(directory, record)
    seconds = time.perf_counter() - started
    result = ExportResult(
        src=info.uri,
        dst=dst_path,
        src_format=info.kind,
        format=format,
        step=info.step,
        world_size=info.world_size,
        dtype=record["dtype"],
        tensors=len(names),
        bytes=total,
        files=files,
        skipped=skipped,
        seconds=seconds,
    )
    log_operation(
        "export",
        uri=dst_path,
        step=info.step,
        nbytes=total,
        seconds=seconds,
        world_size=info.world_size,
        format=format,
        src=info.uri,
    )
    return result


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "EXPORT_RECORD", "ExportResult", "FORMATS", "export", "parse_dtype", "parse_size"]
