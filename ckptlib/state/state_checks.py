"""Checks of a state dict before anything is written: every value pickles, and no two entries
flatten to one DCP key. Each failure is a StateError naming the key."""

from __future__ import annotations

import pickle
from typing import Any, Mapping

import torch

from ckptlib._torch import dcp_shims
from ckptlib.errors import StateError
from ckptlib.format.items.tensor_kinds import unsupported_tensor


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
