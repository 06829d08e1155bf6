"""Export a checkpoint as one consolidated model in Hugging Face's layout.

    ckptlib.export("ckpt/run1", "hf/", model_only=True, dtype=torch.bfloat16)
    # hf/model-00001-of-00003.safetensors ... + hf/model.safetensors.index.json
    # (one hf/model.safetensors when everything fits in one shard, as Hugging Face does)

Any source ckptlib reads (ckptlib or plain DCP at any saved world size, torch.save files,
v0 per-rank files, safetensors; a CheckpointManager root exports its `latest` step), in one
process, one tensor in memory at a time: peak memory is about the largest tensor plus a
few tens of MiB, never the checkpoint (the writers live with their readers in
`ckptlib.format.safetensors` and `ckptlib.format.torch_save`; `ckptlib.format.output` is the
one writer path `export` and `convert` share).

A directory export records what it wrote in `ckptlib_export.json`, written before the first
weight file and completed after the last: `force=True` replaces only an export ckptlib
wrote (it removes exactly the files that record lists), never a directory of other files;
a single file only when it carries ckptlib's mark. A failed export removes what it wrote.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Mapping

import torch

from .errors import CheckpointNotFoundError, NotACheckpointError, StateError, UnsupportedError
from .format.foreign import DEFAULT_PREFIX
from .format.output import (
    DEFAULT_MAX_SHARD_SIZE,
    EXPORT_RECORD,
    overlaps,
    parse_size,
    progress_bar,
    write_output,
)
from .format.shard_files import planned_entries
from .format.source import inspect_checkpoint, open_reader
from .format.streaming import SourceValues
from .observe import log_operation
from .storage import Storage, as_storage, is_remote, root_is_file

FORMATS = ("safetensors", "torch")


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
    if overlaps(source_storage, dst_path):
        raise StateError(f"refusing to export {info.uri} into or over itself ({dst_path})", path=dst_path)

    dtype_name = None if cast is None else str(cast).removeprefix("torch.")
    total = sum(e.nbytes for e in planned_entries(source, names, cast))
    bar = progress_bar(total, f"export {format}", progress)
    try:
        files = write_output(
            source,
            dst_path,
            format=format,
            names=names,
            dtype=cast,
            max_shard_bytes=shard_bytes,
            force=force,
            on_tensor=lambda _fqn, nbytes: bar.update(nbytes),
            record={
                "source": info.uri,
                "step": info.step,
                "export_format": format,
                "dtype": dtype_name,
                "model_only": model_only,
            },
        )
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    result = ExportResult(
        src=info.uri,
        dst=dst_path,
        src_format=info.kind,
        format=format,
        step=info.step,
        world_size=info.world_size,
        dtype=dtype_name,
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
