"""Format-level conversion pieces: full values out of any DCP reader, tensor by tensor, and
streaming writers for DCP (through CkptWriter), a monolithic torch.save file and safetensors.

Memory: a source is read one tensor at a time (``SourceValues.tensor``), so peak memory is
a few times the largest tensor, never the checkpoint. Measured (1 GiB of 16 x 64 MiB
tensors, anonymous memory over the process baseline): torch.save file -> DCP +192 MiB,
safetensors -> DCP +256 MiB (the ranged read's bytes too), DCP -> safetensors +192 MiB,
torch.save file -> safetensors +64 MiB. CkptWriter's loop keeps the previous item and its
serialized blob alive while it asks for the next one, hence about 3x for DCP targets.

- DCP: a save planner whose state holds ``meta`` tensors (shapes only) fetches each real
  tensor when the writer asks for it (``resolve_data``) and drops it after writing.
- safetensors: the header is computed from the metadata first, then tensors are appended.
- torch.save needs one object graph of every tensor, so each tensor is first spilled to a
  file and mapped back (``torch.from_file(shared=True)``); torch.save then copies from the
  mappings. Anonymous memory stays about one tensor; the mapped pages are page cache the
  kernel can drop (they count in RSS while resident: DCP -> torch on the same 1 GiB had
  +192 MiB anonymous but 1.1 GiB of file-backed RSS). The spill needs free disk equal to
  the checkpoint next to the output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import struct
import tempfile
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageReader

from .. import compat
from ..errors import CheckpointError, UnsupportedError
from ..storage import Storage
from .dcp_io import CkptWriter, SafeLoadPlanner
from .legacy import safetensors_name

SAFETENSORS_ALIGN = 8
# Marks a single-file export as ckptlib's (a safetensors __metadata__ key, a torch archive
# record), so that overwriting it with force=True never replaces a file someone else wrote.
EXPORT_MARK = "ckptlib_export"


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _dcp_load(template: dict, reader: StorageReader, planner) -> None:
    with _quiet():
        try:
            compat.dcp_load_no_dist(template, storage_reader=reader, planner=planner)
        except compat.checkpoint_exception_cls() as exc:
            failures = getattr(exc, "failures", None) or {}
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, CheckpointError):
                    raise inner from exc
            raise


class SourceValues:
    """The full values of a checkpoint, read through its DCP reader in this process only."""

    def __init__(self, reader: StorageReader, metadata: Metadata, *, trusted: bool = False):
        self.reader = reader
        self.metadata = metadata
        self.trusted = trusted
        sdm = metadata.state_dict_metadata
        self.tensor_keys = [k for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)]
        self.object_keys = [k for k, v in sdm.items() if isinstance(v, BytesStorageMetadata)]
        planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        self.paths: dict[str, tuple] = {k: tuple(planner_data.get(k) or (k,)) for k in sdm}

    def tensor_meta(self, fqn: str) -> TensorStorageMetadata:
        return self.metadata.state_dict_metadata[fqn]  # type: ignore[return-value]

    def nbytes(self, fqn: str) -> int:
        md = self.tensor_meta(fqn)
        return math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self.tensor_keys)

    def _planner(self) -> SafeLoadPlanner:
        # No key flattening here: each request is one flat key already, and torch 2.9's
        # flattening builds reference cycles that keep fetched tensors alive until gc.
        return SafeLoadPlanner(
            trusted=self.trusted, allow_partial_load=True, flatten_state_dict=False, flatten_sharded_tensors=False
        )

    def tensor(self, fqn: str) -> torch.Tensor:
        """One full tensor, assembled from however many chunks the source stores it in."""
        md = self.tensor_meta(fqn)
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if out.numel():
            _dcp_load({fqn: out}, self.reader, self._planner())
        return out

    def objects(self) -> dict[str, Any]:
        """Every non-tensor value (small: hyper-parameters, counters), by flat key."""
        if not self.object_keys:
            return {}
        template: dict[str, Any] = {k: None for k in self.object_keys}
        _dcp_load(template, self.reader, self._planner())
        return template

    def nested(self, leaves: dict[str, Any]) -> dict[str, Any]:
        """Put flat-keyed values back at their original nesting (from Metadata.planner_data)."""
        root: dict[str, Any] = {}
        for fqn, value in leaves.items():
            compat.set_element(root, self.paths[fqn], value)
        return root


# --------------------------------------------------------------------------- DCP


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a state of meta tensors; real data is fetched per item."""

    def __init__(self, fetch: Callable[[str], torch.Tensor]):
        super().__init__()
        self._fetch = fetch

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        tensor = self._fetch(write_item.index.fqn)
        chunk = write_item.tensor_data.chunk
        if tuple(chunk.sizes) != tuple(tensor.shape) or any(chunk.offsets):
            raise AssertionError(f"{write_item.index.fqn}: expected one whole-tensor chunk, got {chunk}")
        return tensor


def save_dcp_streaming(
    storage: Storage, source: SourceValues, *, on_tensor: Callable[[str, int], None] | None = None
) -> CkptWriter:
    """Write `source` as a DCP checkpoint (one rank) through CkptWriter, one tensor in memory at a time.

    Keys are re-flattened with this torch's rules from the source's nesting, so an old
    (pre-2.4) checkpoint comes out with current keys. Returns the writer, whose
    `file_records` the caller commits in a manifest.
    """
    leaves: dict[str, Any] = {}
    for fqn in source.tensor_keys:
        md = source.tensor_meta(fqn)
        leaves[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
    leaves.update(source.objects())
    state = source.nested(leaves)
    _, mappings = compat.flatten_state_dict(state)
    by_path = {source.paths[k]: k for k in source.tensor_keys}

    def fetch(new_fqn: str) -> torch.Tensor:
        fqn = by_path[tuple(mappings[new_fqn])]
        tensor = source.tensor(fqn)
        if on_tensor is not None:
            on_tensor(fqn, tensor.numel() * tensor.element_size())
        return tensor

    writer = CkptWriter(storage)
    with _quiet():
        compat.dcp_save_no_dist(state, storage_writer=writer, planner=_StreamingSavePlanner(fetch))
    return writer


# --------------------------------------------------------------------------- torch.save


def _spill(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """Write a tensor's bytes to `path` and return a tensor mapped from that file."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    flat.view(torch.uint8).numpy().tofile(path)
    mapped = torch.from_file(path, shared=True, size=flat.numel(), dtype=tensor.dtype)
    return mapped.reshape(tensor.shape)


def write_torch_save(
    path: str, source: SourceValues, *, on_tensor: Callable[[str, int], None] | None = None
) -> int:
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


# --------------------------------------------------------------------------- safetensors


def safetensors_plan(source: SourceValues, prefix: str | None) -> tuple[dict[str, str], list[str]]:
    """({safetensors name: source fqn}, skipped fqns): the tensors under `prefix`, prefix stripped."""
    names: dict[str, str] = {}
    skipped: list[str] = []
    for fqn in source.tensor_keys:
        if prefix and not fqn.startswith(prefix + "."):
            skipped.append(fqn)
            continue
        name = fqn[len(prefix) + 1 :] if prefix else fqn
        names[name] = fqn
    skipped += source.object_keys
    return names, skipped


def _header(
    entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """(header bytes incl. length prefix, [(name, begin, end)]) for entries (name, dtype, shape, nbytes)."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    spans = []
    for name, dtype, shape, nbytes in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans.append((name, offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % SAFETENSORS_ALIGN)
    return struct.pack("<Q", len(text)) + text, spans


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: `cast` applies to floating-point tensors only
    (integer and bool tensors, like optimizer step counts, keep theirs)."""
    return cast if cast is not None and dtype.is_floating_point else dtype


@dataclasses.dataclass
class _Entry:
    name: str  # the name written
    fqn: str  # the source key
    dtype: torch.dtype  # as written
    shape: tuple[int, ...]
    nbytes: int  # as written


def planned_entries(source: SourceValues, names: dict[str, str], cast: torch.dtype | None) -> list[_Entry]:
    out = []
    for name, fqn in names.items():
        md = source.tensor_meta(fqn)
        dtype = out_dtype(md.properties.dtype, cast)
        shape = tuple(md.size)
        out.append(_Entry(name, fqn, dtype, shape, math.prod(shape) * _element_size(dtype)))
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


def _shard_names(stem: str, ext: str, count: int, single: str | None) -> list[str]:
    if count == 1:
        return [single or f"{stem}.{ext}"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)]


def _write_index(directory: str, name: str, files: list[str], groups: list[list]) -> None:
    """Hugging Face's shard index: total tensor bytes and the file of every tensor."""
    index = {
        "metadata": {"total_size": sum(e.nbytes for group in groups for e in group)},
        "weight_map": {e.name: file for file, group in zip(files, groups) for e in group},
    }
    final = os.path.join(directory, name)
    with open(final + ".tmp", "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(final + ".tmp", final)


@contextlib.contextmanager
def _atomic_file(final: str) -> Iterator[str]:
    """A temporary path beside `final`, renamed onto it when the block succeeds."""
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_CAST_PIECE = 1 << 24  # elements cast at a time while writing, so a cast never holds a second full copy


def _write_tensor_bytes(f, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    flat = tensor.reshape(-1)
    if flat.dtype == dtype:
        f.write(memoryview(flat.view(torch.uint8).numpy()))
        return
    for piece in flat.split(_CAST_PIECE):
        f.write(memoryview(piece.to(dtype).view(torch.uint8).numpy()))


def write_safetensors(
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
    """Write `names` (safetensors name -> source fqn) as model.safetensors (or `single_file`),
    or as shards of at most `max_shard_bytes` plus model.safetensors.index.json (Hugging
    Face's layout). `dtype` casts floating-point tensors. Each file is written to a temporary
    name and renamed; `on_file(name)` is called before each file is started; `mark` adds
    EXPORT_MARK to each file's metadata. Returns the file names written."""
    entries = planned_entries(source, names, dtype)
    for e in entries:
        if safetensors_name(e.dtype) is None:
            raise UnsupportedError(f"{e.fqn}: dtype {e.dtype} has no safetensors encoding")
    # Largest element size first keeps every tensor aligned to its element size.
    entries.sort(key=lambda e: (-_element_size(e.dtype), e.name))
    groups = shard_groups(entries, max_shard_bytes)
    files = _shard_names("model", "safetensors", len(groups), single_file)
    os.makedirs(directory, exist_ok=True)
    written = []
    for file, group in zip(files, groups):
        if on_file is not None:
            on_file(file)
        header, _ = _header(
            [(e.name, safetensors_name(e.dtype), e.shape, e.nbytes) for e in group], {EXPORT_MARK: "1"} if mark else None
        )
        with _atomic_file(os.path.join(directory, file)) as tmp, open(tmp, "wb") as f:
            f.write(header)
            for e in group:
                tensor = source.tensor(e.fqn)
                if e.nbytes:
                    _write_tensor_bytes(f, tensor, e.dtype)
                del tensor
                if on_tensor is not None:
                    on_tensor(e.fqn, e.nbytes)
            f.flush()
            os.fsync(f.fileno())
        written.append(file)
    if len(groups) > 1:
        if on_file is not None:
            on_file("model.safetensors.index.json")
        _write_index(directory, "model.safetensors.index.json", files, groups)
        written.append("model.safetensors.index.json")
    return written


def _write_torch_archive(path: str, source: SourceValues, group: list[_Entry], on_tensor, mark: bool) -> None:
    """One torch.save file of the flat dict {name: tensor} for `group`, one tensor in memory."""
    if compat.streaming_torch_save_reason() is None:
        writer = compat.TorchArchiveWriter(path, [(e.name, e.dtype, e.shape) for e in group])
        if mark:
            writer.add_record(EXPORT_MARK, "1")
        for e in group:
            tensor = source.tensor(e.fqn).to(e.dtype).contiguous()
            writer.add(tensor)
            del tensor
            if on_tensor is not None:
                on_tensor(e.fqn, e.nbytes)
        writer.close()
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
    groups = shard_groups(entries, max_shard_bytes)
    files = _shard_names("pytorch_model", "bin", len(groups), single_file)
    os.makedirs(directory, exist_ok=True)
    written = []
    for file, group in zip(files, groups):
        if on_file is not None:
            on_file(file)
        with _atomic_file(os.path.join(directory, file)) as tmp:
            _write_torch_archive(tmp, source, group, on_tensor, mark)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        written.append(file)
    if len(groups) > 1:
        if on_file is not None:
            on_file("pytorch_model.bin.index.json")
        _write_index(directory, "pytorch_model.bin.index.json", files, groups)
        written.append("pytorch_model.bin.index.json")
    return written


def iter_tensors(source: SourceValues) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of `source`, one at a time."""
    for fqn in source.tensor_keys:
        yield fqn, source.tensor(fqn)


__all__ = [
    "EXPORT_MARK", "SourceValues", "iter_tensors", "out_dtype", "planned_entries", "safetensors_plan", "save_dcp_streaming", "shard_groups",
    "write_safetensors", "write_torch_files", "write_torch_save",
]
