"""What the readers of foreign checkpoints share (torch.save, v0, safetensors): `SourceInfo`,
the locators a reader finds each tensor piece or object by, and DCP metadata builders.

Every foreign source is described as DCP ``Metadata`` whose tensors are chunks, so
``dcp.load``'s planner reshards them onto any world size and any placement (see `source`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptlib._torch import dcp_shims, probes
from ckptlib.errors import CheckpointCorruptError, UnsupportedError
from ckptlib.format.items.tensor_kinds import unsupported_tensor
from ckptlib.format.native.layout import CheckpointInfo
from ckptlib.storage.base import Storage
from ckptlib.storage.local import check_regular

DEFAULT_PREFIX = "model"


@dataclasses.dataclass(frozen=True)
class SourceFiles:
    """A directory storage and the file names in it that make up the source."""

    root: Storage
    names: tuple[str, ...]


def file_size(root: Storage, name: str) -> int | None:
    """A file's size, or None when it is absent (no directory walk for local files). Something
    else in its place (a FIFO, a device, a socket, a directory) is NotARegularFileError naming it."""
    path = root.local_path(name)
    if path is not None:
        try:
            if os.path.isfile(path):
                return os.path.getsize(path)
            if os.path.exists(path):
                check_regular(path)
        except OSError:
            return None
        return None
    return root.list(name).get(name)


def file_head(root: Storage, name: str, size: int, n: int = 24) -> bytes:
    try:
        return root.read(name, 0, min(n, size))
    except (FileNotFoundError, EOFError):
        return b""


@dataclasses.dataclass
class SourceInfo(CheckpointInfo):
    """What `inspect_checkpoint` found: CheckpointInfo plus the source's own facts.

    `metadata.storage_data` holds the locators the reader needs, so this object (small,
    picklable) is all another rank needs to build the same reader.
    """

    saved_world_size: int | None = None
    files: tuple[str, ...] = ()
    file_root: str | None = None  # the directory the files are in, when the uri names a file
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def world_size(self) -> int | None:  # type: ignore[override]
        return self.saved_world_size


@dataclasses.dataclass(frozen=True)
class TensorLoc:
    """A tensor stored whole (torch_save) or one rank's piece (v0): file + path inside it."""

    file: str
    path: tuple


@dataclasses.dataclass(frozen=True)
class SafetensorsLoc:
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclasses.dataclass(frozen=True)
class ObjectLoc:
    value: Any


def tensor_metadata(dtype: torch.dtype, size: Iterable[int], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
    )


def new_metadata(sdm: dict, planner_data: dict, storage_data: dict) -> Metadata:
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data)


def check_plain_tensor(value: torch.Tensor, where: str, fqn: str) -> None:
    dtensor = probes.dtensor_cls()
    if (dtensor is not None and isinstance(value, dtensor)) or value.layout != torch.strided:
        raise UnsupportedError(
            f"{where}: {fqn} is a {type(value).__name__} with layout {value.layout}; only plain dense "
            "tensors are read from this format",
            path=where,
        )
    reason = unsupported_tensor(value)
    if reason is not None:
        raise UnsupportedError(f"{where}: {fqn} is {reason}; only plain dense tensors are read", path=where)


def add_objects(objects: dict, prefix_path: tuple, sdm: dict, planner_data: dict, storage_data: dict, where: str):
    """Flatten a tree of plain values with DCP's rules and record every leaf as a bytes item."""
    flat, mappings = dcp_shims.flatten_state_dict(objects)
    for fqn, value in flat.items():
        full = ".".join(map(str, prefix_path + (fqn,))) if prefix_path else fqn
        if isinstance(value, torch.Tensor):
            raise CheckpointCorruptError(f"{where}: objects entry {full} is a tensor", path=where)
        if full in sdm:
            raise CheckpointCorruptError(f"{where}: key {full} appears twice", path=where)
        sdm[full] = BytesStorageMetadata()
        planner_data[full] = prefix_path + tuple(mappings[fqn])
        storage_data[MetadataIndex(full)] = ObjectLoc(value)
