"""Offline conversion between checkpoint formats, one tensor in memory at a time.

    ckptlib.convert("old/pytorch_model.bin", "ckpt/step0")           # -> ckptlib (DCP + manifest)
    ckptlib.convert("ckpt/step100", "export/model.pt", to="torch")  # -> one torch.save file
    ckptlib.convert("ckpt/step100", "export/hf", to="safetensors")  # -> model.safetensors

Sources: anything ``ckptlib.format.source.detect_format`` knows (ckptlib, plain DCP of any
torch since 2.0, torch.save files, v0 per-rank sets, safetensors). Conversion runs in one
process and never needs the checkpoint in memory (see ``ckptlib.format.streaming``). It
writes through the same path as `ckptlib.export` (``ckptlib.format.output``): the same shard
size knob and default, and the same `force` rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from ckptlib import presets
from ckptlib.errors import StateError, UnsupportedError
from ckptlib.format.foreign.foreign import DEFAULT_PREFIX, SourceInfo
from ckptlib.format.foreign.safetensors import safetensors_plan
from ckptlib.format.output import DEFAULT_MAX_SHARD_SIZE, overlaps, parse_size, progress_bar, write_output
from ckptlib.format.source import inspect_checkpoint, open_reader
from ckptlib.format.streaming import SourceValues
from ckptlib.storage import as_storage, is_remote
from ckptlib.storage.base import Storage

TARGETS = ("dcp", "torch", "safetensors")


@dataclasses.dataclass
class ConvertResult:
    src: str
    dst: str
    src_format: str
    to: str
    tensors: int
    objects: int
    tensor_bytes: int
    files: list[str]
    skipped: list[str]
    notes: list[str]
    seconds: float


def _local_path(dst: str | os.PathLike | Storage, to: str) -> str:
    if isinstance(dst, (str, os.PathLike)) and not is_remote(dst):
        path = os.fspath(dst)
        return path[len("file://") :] if path.startswith("file://") else path
    local = dst.local_path() if not isinstance(dst, (str, os.PathLike)) else None
    if local is None:
        raise UnsupportedError(
            f"converting to {to} writes a local file; {dst} is not local (convert to dcp for remote targets)"
        )
    return local


def convert(
    src: str | os.PathLike | Storage,
    dst: str | os.PathLike | Storage,
    *,
    to: str = "dcp",
    force: bool = False,
    progress: bool = False,
    prefix: str | None = DEFAULT_PREFIX,
    trusted: bool = False,
    verify: bool = True,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    preset: str | presets.Preset | None = None,
) -> ConvertResult:
    """Convert the checkpoint at `src` into `dst`, in format `to`:

    - ``"dcp"``: a committed ckptlib checkpoint directory (DCP layout + manifest, world size
      1; loadable at any world size). Keys are re-flattened with this torch's rules.
    - ``"torch"``: one ``torch.save`` file of full tensors nested as the state was saved
      (``{"model": {...}, "optim": {"state": ..., "param_groups": ...}, ...}``).
    - ``"safetensors"``: the tensors under `prefix` (default ``"model"``), prefix stripped:
      ``dst`` is a directory (``model.safetensors``, or shards of at most `max_shard_size`
      plus ``model.safetensors.index.json``; bytes, or "5GB"/"2GiB" as Hugging Face counts,
      default 5GB as `export`'s) or a path ending in ``.safetensors``.

    Refuses to write into an existing `dst` (CheckpointExistsError) unless ``force=True``,
    and even then replaces only what ckptlib wrote (`export`'s rule; for "dcp" that of
    `save(overwrite=True)`); never converts a checkpoint onto itself. `prefix` also names the
    entry a flat model state (torch.save of a state_dict, safetensors) is read as.
    `trusted` allows arbitrary unpickling of the source's objects; `verify` checks a ckptlib
    source's checksums; `progress` draws a progress bar on stderr. `preset` ("composer",
    "torchtitan", "lightning") reads that tool's checkpoint or save folder (its newest
    checkpoint) and allows the plain-data objects it saves without `trusted`; keys are kept.
    """
    client = presets.get(preset) if preset is not None else None
    with client.allowing() if client is not None else contextlib.nullcontext():
        return _convert(
            client.resolve(as_storage(src)) if client is not None else src,
            dst,
            to=to,
            force=force,
            progress=progress,
            prefix=prefix,
            trusted=trusted,
            verify=verify,
            max_shard_size=max_shard_size,
        )


def _convert(
    src: str | os.PathLike | Storage,
    dst: str | os.PathLike | Storage,
    *,
    to: str,
    force: bool,
    progress: bool,
    prefix: str | None,
    trusted: bool,
    verify: bool,
    max_shard_size: int | str | None,
) -> ConvertResult:
    if to == "ckptlib":
        to = "dcp"
    if to not in TARGETS:
        raise ValueError(f"to must be one of {TARGETS}, got {to!r}")
    shard_bytes = parse_size(max_shard_size)
    start = time.monotonic()
    src_storage = as_storage(src)
    info = inspect_checkpoint(src_storage, verify=verify, prefix=prefix, trusted=trusted)
    reader, info = open_reader(src_storage, info=info, verify=verify, prefix=prefix, trusted=trusted)
    source = SourceValues(reader, info.metadata, trusted=trusted, uri=info.uri)
    notes = list(info.notes) if isinstance(info, SourceInfo) else []

    dst_target: str | Storage = as_storage(dst) if to == "dcp" else _local_path(dst, to)
    if overlaps(src_storage, dst_target):
        raise StateError(f"refusing to convert {src_storage.uri} onto itself ({dst})")

    names: dict[str, str] = {}
    skipped: list[str] = []
    if to == "safetensors":
        names, skipped = safetensors_plan(source, prefix)
        if not names:
            raise StateError(
                f"{info.uri}: no tensors under {prefix!r} to write as safetensors "
                f"(keys: {', '.join(source.tensor_keys[:8])}{' ...' if len(source.tensor_keys) > 8 else ''})"
            )
        total = sum(source.nbytes(f) for f in names.values())
    else:
        total = source.total_bytes

    bar = progress_bar(total, f"{info.kind} -> {to}", progress)
    try:
        files = write_output(
            source,
            dst_target,
            format="torch-state" if to == "torch" else to,
            names=names,
            max_shard_bytes=shard_bytes,
            force=force,
            on_tensor=lambda _fqn, nbytes: bar.update(nbytes),
            record={"source": info.uri, "step": info.step, "export_format": to, "prefix": prefix},
            step=info.step,
            metadata=dict(info.manifest.metadata) if info.manifest is not None else {},
        )
    finally:
        bar.close()
    return ConvertResult(
        src=info.uri,
        dst=dst_target.uri if isinstance(dst_target, Storage) else dst_target,
        src_format=info.kind,
        to=to,
        tensors=len(source.tensor_keys) if to != "safetensors" else len(names),
        objects=len(source.object_keys) if to != "safetensors" else 0,
        tensor_bytes=total,
        files=files,
        skipped=skipped,
        notes=notes,
        seconds=time.monotonic() - start,
    )


__all__ = ["ConvertResult", "TARGETS", "convert"]
