"""Checks of a state dict before anything is written: the arguments of the call are what it
takes (`check_call`), every value pickles, and no two entries flatten to one DCP key. Each
failure is a StateError naming the key."""

from __future__ import annotations

import os
import pickle
from typing import Any, Mapping

import torch

from ckptlib._torch import dcp_shims
from ckptlib.errors import StateError
from ckptlib.format.items.tensor_kinds import unsupported_tensor
from ckptlib.storage.base import Storage


def check_call(call: str, uri: Any, state: Any) -> None:
    """`ckptlib.<call>(uri, state)` given what it takes: a path, URI or Storage first and a
    mapping of names to objects second. DCP's order (`dcp.save(state_dict, checkpoint_id=...)`)
    and a bare module or state dict are StateErrors that show the right call."""
    where = isinstance(uri, (str, os.PathLike, Storage))
    if not where and isinstance(uri, Mapping) and isinstance(state, (str, os.PathLike)):
        raise StateError(
            f"ckptlib.{call}(uri, state) takes the path first: call ckptlib.{call}({os.fspath(state)!r}, state) "
            f"(DCP's dcp.{call}(state_dict, checkpoint_id=...) takes them the other way round)",
            path=os.fspath(state),
        )
    if not where:
        raise StateError(
            f"ckptlib.{call}(uri, state): uri must be a path, a URI (file://, s3://, gs://, az://) or a Storage, "
            f"got {type(uri).__name__}"
        )
    _check_mapping(f"ckptlib.{call}({_shown(uri)}, state)", state, None)


def check_manager_call(call: str, root: str, state: Any, step: Any = None) -> None:
    """`CheckpointManager.<call>` given a state mapping (and, for the saves, the step first): a
    path where the state belongs (the manager reads its own root) or `save(state, step)` is a
    StateError that shows the right call."""
    if call != "load" and isinstance(step, Mapping) and isinstance(state, int) and not isinstance(state, bool):
        raise StateError(
            f"CheckpointManager.{call}(step, state) takes the step first: call manager.{call}({state}, state)",
            path=root,
        )
    if isinstance(state, (str, os.PathLike)):
        raise StateError(
            f"CheckpointManager.{call}(state): state must be a mapping of names to objects, got the path "
            f"{os.fspath(state)!r}: the manager reads and writes its own root ({root}); to load a checkpoint "
            "elsewhere, call ckptlib.load(path, state) or give CheckpointManager(initial_load=path)",
            path=root,
        )
    _check_mapping(f"CheckpointManager.{call}", state, root)


def _check_mapping(call: str, state: Any, path: str | None) -> None:
    """The state of `call` (as the message shows it) is a mapping: a module, or anything else, is a
    StateError saying what to pass instead."""
    if isinstance(state, torch.nn.Module):
        raise StateError(
            f"{call}: state must be a mapping of names to objects, got the module {type(state).__name__}: "
            "pass {'model': model}",
            path=path,
        )
    if not isinstance(state, Mapping):
        raise StateError(
            f"{call}: state must be a mapping of names to objects (e.g. {{'model': model, 'optim': optim}}), got "
            f"{type(state).__name__}",
            path=path,
        )


def _shown(uri: Any) -> str:
    return repr(uri.uri) if isinstance(uri, Storage) else repr(os.fspath(uri))


def check_flat_keys(state: Mapping[str, Any], state_dict: dict[str, Any]) -> None:
    """With dotted top-level names (a flat `model.state_dict()`), two entries may flatten to one
    DCP key (`{"a.b": x, "a": {"b": y}}`): a StateError naming it, not DCP's ValueError mid-save."""
    if not any("." in name for name in state):
        return
    try:
        dcp_shims.flatten_state_dict(state_dict)
    except ValueError as exc:
        key = str(exc).rsplit(" ", 1)[-1]
        raise StateError(
            f"state keys collide: two entries are both saved under the key {key!r} (dots in a name nest it)"
        ) from exc


class _NullSink:
    def write(self, data: bytes) -> int:
        return len(data)


class _TensorSkippingPickler(pickle.Pickler):
    """Pickles into nothing, treating tensors and storages as external (as torch.save does)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


def check_picklable(value: Any, path: str) -> None:
    """Every non-tensor value of the state dict must pickle (DCP torch.saves it): a lambda, an
    open file, a lock, a socket or a generator is a StateError naming its dotted key, raised
    before anything is written rather than as a PicklingError from the middle of a save; so is
    a tensor DCP cannot store (`tensor_kinds`: sparse, nested, quantized, meta, sub-byte)."""
    if isinstance(value, torch.Tensor):
        reason = unsupported_tensor(value)
        if reason is not None:
            raise StateError(f"state value {path} is {reason}; nothing was written")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            check_picklable(v, f"{path}.{k}" if path else str(k))
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_picklable(v, f"{path}.{i}" if path else str(i))
        return
    try:
        _TensorSkippingPickler(_NullSink(), protocol=2).dump(value)
    except Exception as exc:  # noqa: BLE001 - any failure to pickle, whatever the object raises
        raise StateError(
            f"state value {path} ({type(value).__name__}) cannot be saved: it does not pickle "
            f"({type(exc).__name__}: {exc}); save plain values, tensors or objects with state_dict()"
        ) from exc
