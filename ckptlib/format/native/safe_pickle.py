"""Restricted unpickling for DCP's `.metadata` (a pickle: plain DCP runs any code in it).

Only DCP's own metadata classes, torch dtypes/Size/layouts/memory formats and a few
builtins may be named by the pickle; any other global raises UnsafeCheckpointError
before anything is called. Classes pickled under torch 1.13's module names
(`torch.distributed._shard.checkpoint.*`) are rebuilt as today's (`_torch.dcp_shims.current_pickle_module`).
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from ckptlib._torch import dcp_shims
from ckptlib.errors import CheckpointCorruptError, UnsafeCheckpointError
from ckptlib.format.items import zip_directory

# Modules whose *classes* (types only, never functions) may be rebuilt.
_CLASS_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed._shard.metadata",
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._shard.sharding_spec.api",
)
# Never a callable that allocates from a number: `bytearray(2**31)` is 2 GB built from a
# 40-byte pickle (DCP metadata holds no bytearray). Containers only copy what the pickle holds.
_BUILTINS = {"set", "frozenset", "slice", "complex", "object", "tuple", "list", "dict"}
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
        module = dcp_shims.current_pickle_module(module)
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


class _Stub:
    """Stands for every object while `check_no_allocating_calls` replays a pickle."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Stub":
        return _Stub()

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class _AllocationScan(pickle.Unpickler):
    """Replays a pickle calling nothing real: every global is a stub, except the builtins that
    allocate from a number (`bytearray(2**31)`), which refuse a count."""

    def __init__(self, data: bytes, where: str, path: str | None):
        super().__init__(io.BytesIO(data))
        self.where, self.path = where, path

    def find_class(self, module: str, name: str) -> Any:
        if module in ("builtins", "__builtin__") and name in ("bytearray", "bytes"):
            where, self_path = self.where, self.path

            def refuse_count(*args: Any, **kwargs: Any) -> _Stub:
                if args and isinstance(args[0], int) and not isinstance(args[0], bool):
                    raise UnsafeCheckpointError(
                        f"{where}: the pickle builds {name}({args[0]}) from a number: {args[0]} bytes allocated from a "
                        "few bytes of file; refusing it (pass trusted=True only if you trust this checkpoint's author)",
                        path=self_path,
                    )
                return _Stub()

            return refuse_count
        return _Stub

    def persistent_load(self, pid: Any) -> Any:
        return _Stub()


def check_no_allocating_calls(data: bytes, where: str, path: str | None = None) -> None:
    """UnsafeCheckpointError if the pickle `data` calls bytearray or bytes with a count (what
    torch's weights_only unpickler would run: it allows bytearray). A pickle that cannot be
    replayed is left to the real unpickler, which reports it. `where` starts the message;
    `path` is the error's path (None: the caller adds the file)."""
    try:
        _AllocationScan(data, where, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - not ours to judge; torch.load reports it
        pass


def load_object(data: bytes, what: str) -> Any:
    """A stored object item (DCP torch.saves each non-tensor value) unpickled with weights_only;
    UnsafeCheckpointError naming `what` when that needs arbitrary code (pass trusted=True to
    run it), or when it would allocate from a number (see `check_no_allocating_calls`)."""
    header = zip_directory.tensor_pickle(lambda pos, n: data[pos : pos + n], len(data), limit=len(data))
    if header is not None:
        check_no_allocating_calls(header, what)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is many lines of advice; keep the global it refused.
        text = str(exc)
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            detail = f"it names the global {found.group(1)}"
        else:
            found = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
            detail = (found.group(1) if found else (text.strip().splitlines() or [""])[0])[:200]
        raise UnsafeCheckpointError(
            f"{what} needs arbitrary unpickling ({detail}), which weights_only loading refuses; pass "
            "trusted=True only if you trust this checkpoint's author"
        ) from exc


def safe_loads(data: bytes, where: str) -> Any:
    """Unpickle `data` allowing only DCP metadata types; `where` names the file in errors."""
    try:
        return _RestrictedUnpickler(data, where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or garbage bytes
        raise CheckpointCorruptError(
            f"{where}: cannot read DCP metadata ({type(exc).__name__}: {exc})", path=where
        ) from exc
