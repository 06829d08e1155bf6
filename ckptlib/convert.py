"""Offline conversion between checkpoint formats, one tensor in memory at a time.

    ckptlib.convert("old/pytorch_model.bin", "ckpt/step0")           # -> ckptlib (DCP + manifest)
    ckptlib.convert("ckpt/step100", "export/model.pt", to="torch")  # -> one torch.save file
    ckptlib.convert("ckpt/step100", "export/hf", to="safetensors")  # -> model.safetensors

Sources: anything ``ckptlib.format.source.detect_format`` knows (ckptlib, plain DCP of any
torch since 2.0, torch.save files, v0 per-rank sets, safetensors). Conversion runs in one
process and never needs the checkpoint in memory (see ``ckptlib.format.streaming``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

from .errors import CheckpointExistsError, OverwriteRefusedError, StateError, UnsupportedError
from .format import prepare_save_target
from .format.deletion import remove_failed_save
from .format.foreign import DEFAULT_PREFIX, SourceInfo
from .format.layout import commit_manifest
from .format.safetensors import safetensors_plan, write_safetensors
from .format.source import inspect_checkpoint, open_reader
from .format.streaming import SourceValues, save_dcp_streaming
from .format.torch_save import write_torch_save
from .storage import Storage, as_storage, is_remote

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


def _same_place(src: Storage, dst_path: str | None, dst: Storage | None) -> bool:
    a = src.local_path()
    b = dst_path if dst_path is not None else (dst.local_path() if dst is not None else None)
    if a is None or b is None:
        return src.uri == (dst.uri if dst is not None else b)
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or b.startswith(a + os.sep) or a.startswith(b + os.sep)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled, leave=False)


def convert(
    src: str | os.PathLike | Storage,
    dst: str | os.PathLike | Storage,
    *,
    to: str = "dcp",
    force: bool = False,
    progress: bool = True,
    prefix: str | None = DEFAULT_PREFIX,
    trusted: bool = False,
    verify: bool = True,
    max_shard_bytes: int | None = None,
) -> ConvertResult:
    """Convert the checkpoint at `src` into `dst`, in format `to`:

    - ``"dcp"``: a committed ckptlib checkpoint directory (DCP layout + manifest, world size
      1; loadable at any world size). Keys are re-flattened with this torch's rules.
    - ``"torch"``: one ``torch.save`` file of full tensors nested as the state was saved
      (``{"model": {...}, "optim": {"state": ..., "param_groups": ...}, ...}``).
    - ``"safetensors"``: the tensors under `prefix` (default ``"model"``), prefix stripped:
      ``dst`` is a directory (``model.safetensors``, or shards of at most `max_shard_bytes`
      plus ``model.safetensors.index.json``) or a path ending in ``.safetensors``.

    Refuses to write into an existing `dst` (CheckpointExistsError) unless ``force=True``;
    never converts a checkpoint onto itself. `prefix` also names the entry a flat model
    state (torch.save of a state_dict, safetensors) is read as. `trusted` allows arbitrary
    unpickling of the source's objects; `verify` checks a ckptlib source's checksums.
    """
    if to == "ckptlib":
        to = "dcp"
    if to not in TARGETS:
        raise ValueError(f"to must be one of {TARGETS}, got {to!r}")
    start = time.monotonic()
    src_storage = as_storage(src)
    info = inspect_checkpoint(src_storage, verify=verify, prefix=prefix, trusted=trusted)
    reader, info = open_reader(src_storage, info=info, verify=verify, prefix=prefix, trusted=trusted)
    source = SourceValues(reader, info.metadata, trusted=trusted)
    notes = list(info.notes) if isinstance(info, SourceInfo) else []

    dst_storage = as_storage(dst) if to == "dcp" else None
    dst_path = None if to == "dcp" else _local_path(dst, to)
    if _same_place(src_storage, dst_path, dst_storage):
        raise StateError(f"refusing to convert {src_storage.uri} onto itself ({dst})")

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

    bar = _progress(total, f"{info.kind} -> {to}", progress)

    def tick(_fqn: str, nbytes: int) -> None:
        bar.update(nbytes)

    try:
        if to == "dcp":
            assert dst_storage is not None
            try:
                prepare_save_target(dst_storage, overwrite=force, world_size=1)
            except OverwriteRefusedError:
                raise
            except CheckpointExistsError as exc:
                raise CheckpointExistsError(
                    f"{dst_storage.uri} already exists (pass force=True, or --force, to overwrite)", path=exc.path
                ) from exc
            try:
                writer = save_dcp_streaming(dst_storage, source, on_tensor=tick)
                commit_manifest(
                    dst_storage,
                    writer.file_records,
                    world_size=1,
                    step=info.step,
                    metadata=dict(info.manifest.metadata) if info.manifest is not None else {},
                )
            except BaseException:
                remove_failed_save(dst_storage, shard=None, coordinator=True, prepared=True)  # e.g. disk full
                raise
            files = sorted(writer.file_records)
            where = dst_storage.uri
        elif to == "torch":
            assert dst_path is not None
            if os.path.isdir(dst_path):
                raise CheckpointExistsError(
                    f"{dst_path} is a directory; converting to torch writes one file", path=dst_path
                )
            if os.path.lexists(dst_path):
                if not force:
                    raise CheckpointExistsError(
                        f"{dst_path} already exists (pass force=True to overwrite)", path=dst_path
                    )
                _check_replaceable_file(dst_path)
            write_torch_save(dst_path, source, on_tensor=tick)
            files = [os.path.basename(dst_path)]
            where = dst_path
        else:
            assert dst_path is not None
            single = dst_path.endswith(".safetensors")
            directory = os.path.dirname(os.path.abspath(dst_path)) if single else dst_path
            if single or (os.path.lexists(dst_path) and not os.path.isdir(dst_path)):
                if os.path.lexists(dst_path):
                    if not force:
                        raise CheckpointExistsError(
                            f"{dst_path} already exists (pass force=True to overwrite)", path=dst_path
                        )
                    _check_replaceable_file(dst_path)
                    if not single:
                        os.unlink(dst_path)  # a recognised checkpoint file where the export directory goes
            elif os.path.isdir(dst_path) and os.listdir(dst_path):
                if not force:
                    raise CheckpointExistsError(
                        f"{dst_path} already exists and is not empty (pass force=True to overwrite)", path=dst_path
                    )
                _clear_safetensors(dst_path)
            files = write_safetensors(
                directory,
                source,
                names,
                single_file=os.path.basename(dst_path) if single else None,
                max_shard_bytes=None if single else max_shard_bytes,
                on_tensor=tick,
            )
            where = dst_path
    finally:
        bar.close()
    return ConvertResult(
        src=info.uri,
        dst=where,
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


_EXPORT_FILE_RE = re.compile(r"^model(?:-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")


def _check_replaceable_file(path: str) -> None:
    """force=True may replace a file only if it is a checkpoint file ckptlib recognises (a
    torch.save or safetensors file, by its content); anything else is OverwriteRefusedError,
    untouched."""
    from .format.torch_save import looks_like_checkpoint_file

    if not os.path.isfile(path):
        raise OverwriteRefusedError(f"{path} exists and is not a regular file; refusing to overwrite it", path=path)
    if not looks_like_checkpoint_file(path):
        raise OverwriteRefusedError(
            f"{path} is not a checkpoint file ckptlib recognises (a torch.save or safetensors file); refusing to "
            "overwrite it",
            path=path,
        )


def _clear_safetensors(path: str) -> None:
    """force=True on a safetensors directory: remove what a previous export wrote (model.safetensors,
    its model-NNNNN-of-NNNNN shards and index), nothing else: an HF model directory keeps its
    config, tokenizer and any other file."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if _EXPORT_FILE_RE.match(name) and (os.path.isfile(full) or os.path.islink(full)):
            os.unlink(full)


__all__ = ["ConvertResult", "TARGETS", "convert"]
