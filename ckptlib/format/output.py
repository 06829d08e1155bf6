"""The one writer path of `ckptlib.convert` and `ckptlib.export`: prepare the destination,
stream the tensors, write the shards, index and record, clean up a partial output.

Outputs (`format`):
- "dcp": a committed ckptlib checkpoint directory, through a `SaveTransaction` (world size 1);
- "torch-state": one `torch.save` file of the whole state nested as it was saved;
- "torch" / "safetensors": Hugging Face's layout of the named tensors: one file, or shards
  of at most `max_shard_bytes` plus an index (a destination ending in the format's suffix
  is always one file).

One `force` rule for all of them: replace only what ckptlib itself wrote, never without
`force`. A checkpoint directory: its own files only (`layout.prepare_save_target`, the rule
of `save(overwrite=True)`). A directory of Hugging Face files: the files its
`ckptlib_export.json` lists (written before the first file and completed after the last, and
naming no absolute path), so a `config.json` or tokenizer a user put there stays; a directory
without that record may hold such side files (they are kept) but no weights or checkpoint
files ckptlib did not write. Side files an export copies in (`side_files`) are listed in the
record like its weights; one already there with other bytes is refused. A single file: one
that carries ckptlib's mark (`EXPORT_MARK`: a safetensors `__metadata__` key, a record in a
torch archive).

Every output is streamed one tensor at a time (see `streaming`). A failure removes what
this write created: a checkpoint's files (the transaction), a directory output's listed
files and record (and the directory when this write created it), a single file's temporary
name; the destination's other files are never touched.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import struct
import zipfile
from typing import Any, Callable

import torch

from ckptlib.errors import CheckpointExistsError, OverwriteRefusedError
from ckptlib.format.foreign.safetensors import write_safetensors
from ckptlib.format.foreign.safetensors_hf import is_weight_file
from ckptlib.format.foreign.shard_files import EXPORT_MARK, atomic_file, planned_entries, write_failed
from ckptlib.format.foreign.torch_save import write_torch_files, write_torch_save
from ckptlib.format.streaming import SourceValues, save_dcp_streaming
from ckptlib.format.write.transaction import SaveTransaction
from ckptlib.storage.base import Storage

FORMATS = ("dcp", "torch-state", "torch", "safetensors")
EXPORT_RECORD = "ckptlib_export.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
SINGLE_SUFFIXES = {"safetensors": (".safetensors",), "torch": (".bin", ".pt", ".pth")}
# Every name Hugging Face's layout of a format may have (one file, shards, the index): a file of
# such a name that an export's record does not list is a user's, and blocks a forced export.
LAYOUT_NAMES = {
    "safetensors": re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$"),
    "torch": re.compile(r"^pytorch_model(-\d{5}-of-\d{5})?\.bin(\.index\.json)?$"),
}
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


def is_single_file(path: str, format: str) -> bool:
    """Whether `path` names one file of `format` (else a directory of Hugging Face's layout)."""
    return format == "torch-state" or path.endswith(SINGLE_SUFFIXES[format])


def overlaps(src: Storage, dst: str | Storage) -> bool:
    """Whether writing to `dst` would write into or over the checkpoint at `src`."""
    a = src.local_path()
    b = dst if isinstance(dst, str) else dst.local_path()
    if a is None or b is None:
        return src.uri == (dst if isinstance(dst, str) else dst.uri)
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or b.startswith(a + os.sep) or a.startswith(b + os.sep)


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar in bytes on stderr (a no-op when not `enabled`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled, leave=False)


# --------------------------------------------------------------------------- the destination


def read_record(directory: str) -> dict[str, Any] | None:
    """The record of the output ckptlib wrote into `directory`, or None (none, or not ours)."""
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


def _kind_of(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a symbolic link to nothing"
    for test, name in (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISREG, "a file"),
    ):
        if test(mode):
            return name
    return "not a regular file or directory"


def _check_destination(path: str, format: str, force: bool) -> None:
    """Refuse, before anything is written, a destination that cannot be one: below a file (or a
    FIFO, a device) instead of a directory, or itself a FIFO, device or socket; a directory
    output onto a file. Named errors (`_refusal`), never an OSError from the middle of a write."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise _refusal(force)(
            f"cannot write {path}: {parent} is {_kind_of(parent)}, not a directory; refusing to write there", path=path
        )
    if not os.path.lexists(full) or os.path.isdir(full):
        return
    if not os.path.isfile(full):
        raise _refusal(force)(f"{path} is {_kind_of(full)}; refusing to write there", path=path)
    if format == "dcp" or not is_single_file(path, format):
        raise _refusal(force)(f"{path} is a file; a {format} output is a directory there", path=path)


def _refusal(force: bool) -> type[CheckpointExistsError]:
    """What refusing a destination ckptlib did not write raises: with `force` it is also an
    OverwriteRefusedError (a CheckpointExistsError), the error of every refused overwrite."""
    return OverwriteRefusedError if force else CheckpointExistsError


def _remove_listed(path: str, record: dict[str, Any], *, keep_record: bool = False) -> None:
    """Remove the files `record` lists in `path` and their temporary files, then the record, or
    with `keep_record` mark it incomplete first and keep it: a crash half-way never leaves a
    complete-looking export with files missing, nor a directory a forced export must refuse."""
    names = record["files"]
    for name in names:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointExistsError(f"{path}/{EXPORT_RECORD} lists an unsafe file name {name!r}", path=path)
    if keep_record and record.get("complete") is not False:
        _write_record(path, {**record, "complete": False})
    temporary = re.compile("^(?:" + "|".join(re.escape(n) for n in [*names, EXPORT_RECORD]) + r")\.tmp(?:-\d+)?$")
    with os.scandir(path) as entries:
        leftovers = [e.name for e in entries if temporary.match(e.name) and e.is_file(follow_symlinks=False)]
    for name in [*names, *leftovers]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    if not keep_record:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, EXPORT_RECORD))


def _clear_directory(path: str, force: bool, format: str) -> None:
    """Make `path` a directory to write `format`'s layout into (absent, empty, or an earlier
    export whose listed files are removed), or refuse before touching anything."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise _refusal(force)(f"{path} is a file; exporting writes a directory there", path=path)
    if not os.path.isdir(path) or not os.listdir(path):
        return
    record = read_record(path)
    if record is None:
        weights = sorted(name for name in os.listdir(path) if is_weight_file(name))
        if not weights:
            return  # side files only (config, tokenizer, README): kept, the export goes beside them
        raise _refusal(force)(
            f"{path} exists and is not an export ckptlib wrote (no {EXPORT_RECORD}; it holds "
            f"{', '.join(weights[:5])}{' ...' if len(weights) > 5 else ''}); refusing to write into it"
            + (" even with force" if force else "")
            + ": choose an empty or new directory",
            path=path,
        )
    if not force:
        raise CheckpointExistsError(
            f"{path} already holds an export (pass force=True, or --force, to replace it)", path=path
        )
    listed = set(record["files"])
    theirs = sorted(n for n in os.listdir(path) if LAYOUT_NAMES[format].match(n) and n not in listed)
    if theirs:
        raise OverwriteRefusedError(
            f"{path} holds {', '.join(theirs)}, which the export there ({EXPORT_RECORD}) did not write and this "
            f"{format} export would replace; refusing even with force: move {'them' if len(theirs) > 1 else 'it'} "
            "or choose another directory",
            path=path,
        )
    _remove_listed(path, record, keep_record=True)  # the new export's record replaces it


def _is_marked(path: str, format: str) -> bool:
    """Whether the file at `path` is a single-file output ckptlib wrote (its embedded mark)."""
    try:
        if format == "safetensors":
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, 1 << 24)))
            return header.get("__metadata__", {}).get(EXPORT_MARK) is not None
        with zipfile.ZipFile(path) as archive:
            return any(n.endswith("/" + EXPORT_MARK) for n in archive.namelist())
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False


def _check_single_file(path: str, format: str, force: bool) -> None:
    if os.path.isdir(path):
        raise CheckpointExistsError(f"{path} is a directory; a {format} file name was given", path=path)
    if not os.path.lexists(path):
        return
    if not os.path.isfile(path) or not _is_marked(path, format):
        raise _refusal(force)(
            f"{path} exists and is not an export ckptlib wrote; refusing to overwrite it"
            + (" even with force" if force else ""),
            path=path,
        )
    if not force:
        raise CheckpointExistsError(f"{path} already exists (pass force=True, or --force, to overwrite)", path=path)


def _mark_torch_archive(path: str) -> None:
    """Add EXPORT_MARK as one more record of the torch.save archive at `path` (torch.load
    ignores it; the records before it keep their bytes and offsets), durably."""
    with zipfile.ZipFile(path, "a") as archive:
        prefix = archive.namelist()[0].split("/")[0]
        archive.writestr(f"{prefix}/{EXPORT_MARK}", "1")
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


# --------------------------------------------------------------------------- writing


def write_output(
    source: SourceValues,
    dst: str | Storage,
    *,
    format: str,
    names: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    force: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
    record: dict[str, Any] | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    side_files: dict[str, bytes] | None = None,
) -> list[str]:
    """Write `source` to `dst` as `format` (see the module docstring) and return the names of
    the files written. `names` ({written name: source key}), `dtype` (floating-point tensors
    are cast) and `max_shard_bytes` apply to "torch" and "safetensors"; `record` holds what a
    directory output's record says besides its files; `side_files` ({name: bytes}: config,
    tokenizer) are copied into a directory output; `step` and `metadata` go into a "dcp"
    output's manifest. `dst` is a Storage for "dcp", a local path otherwise."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    local = dst if isinstance(dst, str) else dst.local_path()
    if local is not None:
        _check_destination(local, format, force)
    if format == "dcp":
        assert isinstance(dst, Storage)
        return _write_checkpoint(source, dst, force=force, on_tensor=on_tensor, step=step, metadata=metadata)
    assert isinstance(dst, str)
    try:
        return _write_files(
            source,
            dst,
            format=format,
            names=names,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            force=force,
            on_tensor=on_tensor,
            record=record,
            side_files=side_files,
        )
    except (OSError, RuntimeError) as exc:  # writing the record, the index, the mark: a full disk
        error = write_failed(exc, dst)
        if error is exc:
            raise
        raise error from exc


def _write_files(
    source: SourceValues,
    dst: str,
    *,
    format: str,
    names: dict[str, str] | None,
    dtype: torch.dtype | None,
    max_shard_bytes: int | None,
    force: bool,
    on_tensor: Callable[[str, int], None] | None,
    record: dict[str, Any] | None,
    side_files: dict[str, bytes] | None,
) -> list[str]:
    """`write_output` of a local file or directory of files (every format but "dcp")."""
    if is_single_file(dst, format):
        _check_single_file(dst, format, force)
        directory = os.path.dirname(os.path.abspath(dst))
        os.makedirs(directory, exist_ok=True)
        if format == "torch-state":
            with atomic_file(dst) as tmp:
                write_torch_save(tmp, source, on_tensor=on_tensor)
                _mark_torch_archive(tmp)
            return [os.path.basename(dst)]
        write = write_safetensors if format == "safetensors" else write_torch_files
        return write(
            directory,
            source,
            names or {},
            single_file=os.path.basename(dst),
            dtype=dtype,
            on_tensor=on_tensor,
            mark=True,
        )
    return _write_directory(
        source,
        dst,
        format=format,
        names=names or {},
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        force=force,
        on_tensor=on_tensor,
        record=record or {},
        side_files=side_files or {},
    )


def _new_side_files(directory: str, side_files: dict[str, bytes], force: bool) -> dict[str, bytes]:
    """The side files to write: those not already in `directory` with the same bytes; one there
    with other bytes is refused (it is not ckptlib's to replace)."""
    out = {}
    for name, data in side_files.items():
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            try:
                same = os.path.isfile(path) and open(path, "rb").read() == data
            except OSError:
                same = False
            if same:
                continue
            raise _refusal(force)(
                f"{path} exists with other contents than the {name} to copy in; refusing to replace a file "
                "ckptlib did not write (remove it, or copy nothing over it)",
                path=path,
            )
        out[name] = data
    return out


def _write_side_file(directory: str, name: str, data: bytes) -> None:
    with atomic_file(os.path.join(directory, name)) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _write_checkpoint(
    source: SourceValues,
    dst: Storage,
    *,
    force: bool,
    on_tensor: Callable[[str, int], None] | None,
    step: int | None,
    metadata: dict[str, Any] | None,
) -> list[str]:
    transaction = SaveTransaction(dst, world_size=1, step=step, metadata=metadata, overwrite=force)
    try:
        transaction.run(lambda writer: save_dcp_streaming(writer, source, on_tensor=on_tensor))
    except OverwriteRefusedError:
        raise
    except CheckpointExistsError as exc:
        raise CheckpointExistsError(
            f"{dst.uri} already exists (pass force=True, or --force, to overwrite)", path=exc.path
        ) from exc
    return sorted(transaction.files)


def _write_directory(
    source: SourceValues,
    directory: str,
    *,
    format: str,
    names: dict[str, str],
    dtype: torch.dtype | None,
    max_shard_bytes: int | None,
    force: bool,
    on_tensor: Callable[[str, int], None] | None,
    record: dict[str, Any],
    side_files: dict[str, bytes],
) -> list[str]:
    """Hugging Face's layout in `directory` (and its side files), recorded in EXPORT_RECORD as
    it is written."""
    _clear_directory(directory, force, format)
    created = not os.path.isdir(directory)
    side = _new_side_files(directory, side_files, force) if not created else dict(side_files)
    os.makedirs(directory, exist_ok=True)
    doc: dict[str, Any] = {"format": "ckptlib-export", "version": 1, "complete": False, **record, "files": []}

    def on_file(name: str) -> None:
        if os.path.lexists(os.path.join(directory, name)):  # not ours: ours were removed above
            raise OverwriteRefusedError(
                f"{directory}/{name} appeared during the export and is not ckptlib's; refusing to replace it",
                path=f"{directory}/{name}",
            )
        doc["files"].append(name)
        _write_record(directory, doc)

    write = write_safetensors if format == "safetensors" else write_torch_files
    try:
        files = write(
            directory,
            source,
            names,
            max_shard_bytes=max_shard_bytes,
            dtype=dtype,
            on_tensor=on_tensor,
            on_file=on_file,
        )
        for name, data in sorted(side.items()):
            on_file(name)
            _write_side_file(directory, name, data)
            files.append(name)
    except BaseException:
        with contextlib.suppress(Exception):  # the write's own error is what the caller sees
            # With a user's files there, the record stays (incomplete): a forced export may retry.
            users = [n for n in os.listdir(directory) if not n.startswith((*doc["files"], EXPORT_RECORD))]
            _remove_listed(directory, doc, keep_record=bool(users))
            if created and not os.listdir(directory):
                os.rmdir(directory)
        raise
    entries = planned_entries(source, names, dtype)
    doc["complete"] = True
    doc["files"] = files
    doc["total_size"] = sum(entry.nbytes for entry in entries)
    doc["total_parameters"] = sum(math.prod(entry.shape) for entry in entries)
    _write_record(directory, doc)
    return files


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "EXPORT_RECORD",
    "FORMATS",
    "is_single_file",
    "overlaps",
    "parse_size",
    "progress_bar",
    "read_record",
    "write_output",
]
