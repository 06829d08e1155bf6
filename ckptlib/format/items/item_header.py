"""A torch.save'd tensor item's own header (its data.pkl): dtype, shape, strides and storage
offset, read without unpickling anything torch would run. The reader compares it with what
`.metadata` declares before it reads intact bytes as a tensor of that shape."""

from __future__ import annotations

import io
import pickle

import torch

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


def _tensor_header(storage, storage_offset, size, stride, *_rest):
    return storage, storage_offset, size, stride


class _HeaderUnpickler(pickle.Unpickler):
    """Reads a torch.save'd plain tensor's data.pkl for its dtype, shape, strides and storage
    offset, calling nothing: every global other than the two a plain tensor names is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_header
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


def pickled_tensor_header(data: bytes | None) -> tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int] | None:
    """(dtype, shape, strides, storage offset) of the plain tensor a data.pkl describes, or None."""
    if data is None:
        return None
    try:
        storage, offset, size, stride = _HeaderUnpickler(io.BytesIO(data)).load()
        dtype = storage[1]
        if storage[0] != "storage" or not isinstance(dtype, torch.dtype):
            return None
        return dtype, tuple(int(s) for s in size), tuple(int(s) for s in stride), int(offset)
    except Exception:  # noqa: BLE001 - anything unexpected: the caller takes the torch.load path
        return None


__all__ = ["pickled_tensor_header"]
