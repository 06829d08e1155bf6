"""The tensors ckptlib saves and loads into: plain dense tensors (and DTensors of them) whose
elements are whole bytes. Anything else is refused by key before a save writes anything or a
load reads anything, rather than with torch's own error from the middle of DCP."""

from __future__ import annotations

from typing import Any

import torch

from ckptlib._torch import probes


def _whole_bytes(dtype: torch.dtype) -> bool:
    """Whether DCP can store elements of `dtype`: floats, complex, bool and integers (not the
    sub-byte int1..int7/uint1..uint7, the opaque bits* types or the quantized q* types)."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return True
    try:
        torch.iinfo(dtype)
    except TypeError:
        return False
    return True


def unsupported_tensor(value: Any) -> str | None:
    """Why ckptlib cannot save `value` or load into it, or None when it can."""
    dtensor = probes.dtensor_cls()
    if dtensor is not None and isinstance(value, dtensor):
        value = value.to_local()
    if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
        return None  # ShardedTensor and other subclasses: their own code decides
    if value.is_nested:
        return "a nested tensor (torch.nested), which DCP cannot store: use its components (value.unbind())"
    if value.layout != torch.strided:
        return f"a sparse tensor (layout {value.layout}), which DCP cannot store: use a dense copy (value.to_dense())"
    if value.is_quantized:
        return (
            f"a quantized tensor ({value.dtype}), which DCP cannot store: use value.dequantize(), or value.int_repr() "
            "with its scale and zero point"
        )
    if value.device.type == "meta":
        return (
            "a meta tensor, which holds no data: materialize it first (module.to_empty(device=...), then initialize "
            "or load it)"
        )
    if not _whole_bytes(value.dtype):
        return f"a tensor of dtype {value.dtype}, whose elements are not whole bytes: keep it packed in uint8"
    return None


__all__ = ["unsupported_tensor"]
