"""Restricted unpickling for DCP's `.metadata` (a pickle: plain DCP runs any code in it).

Only DCP's own metadata classes, torch dtypes/Size/layouts/memory formats and a few
builtins may be named by the pickle; any other global raises UnsafeCheckpointError
before anything is called. Classes pickled under torch 1.13's module names
(`torch.distributed._shard.checkpoint.*`) are rebuilt as today's (`compat.current_pickle_module`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .. import compat
from ..errors import CheckpointCorruptError, UnsafeCheckpointError

# Modules whose *classes* (types only, never functions) may be rebuilt.
_CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed._shard.metadata",
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._shard.sharding_spec.api",
)
_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "object", "tuple", "list", "dict"}
# torch.layout pickles as a call to torch.serialization._get_layout(name): a lookup, no side effects.
_OTHER = {
    ("collections", "OrderedDict"),
    ("copyreg", "_reconstructor"),
    ("torch.serialization", "_get_layout"),
    # dcp.save records the checkpoint path (StorageMeta.checkpoint_id) as a pathlib object.
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


def _torch_global(name: str) -> Any | None:
    value = getattr(torch, name, None)
    if name == "Size":
        return torch.Size
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return value
    return None


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # torch 1.13 pickled DCP's classes under torch.distributed._shard.checkpoint.*: rebuild
        # them as today's classes, or DCP rejects them as foreign types.
        module = compat.current_pickle_module(module)
        if module == "torch":
            found = _torch_global(name)
            if found is not None:
                return found
        elif module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        elif (module, name) in _OTHER:
            return super().find_class(module, name)
        elif module in _CLASS_MODULES and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise UnsafeCheckpointError(
            f"{self.where}: refusing to unpickle global {module}.{name} "
            "(not a DCP metadata class; the file may be crafted to run code)",
            path=self.where,
        )


def safe_loads(data: bytes, where: str) -> Any:
    """Unpickle `data` allowing only DCP metadata types; `where` names the file in errors."""
    try:
        return _RestrictedUnpickler(data, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbage bytes
        raise CheckpointCorruptError(f"{where}: cannot read DCP metadata ({type(exc).__name__}: {exc})", path=where) from exc
