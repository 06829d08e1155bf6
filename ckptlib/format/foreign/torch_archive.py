"""torch.save's archive of a flat {name: tensor} dict, written one tensor at a time.

torch.save needs every tensor in memory at once. `TorchArchiveWriter` streams through torch's
own zip writer instead, with the pickle built from shapes and dtypes alone, so an export holds
one tensor at a time. `streaming_torch_save_reason` compares its bytes with torch.save's once
per process; where they differ, `torch_save` falls back to spilling tensors for torch.save.
"""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pickle
import sys
from typing import Any

import torch

from ckptlib._torch import serialization


class _StorageRef:
    """A storage torch.save would write as record `data/<key>` (only its type and size known)."""

    def __init__(self, storage_type: Any, key: str, numel: int):
        self.storage_type, self.key, self.numel = storage_type, key, numel


class _TensorRef:
    def __init__(self, storage: _StorageRef, shape: tuple[int, ...], dtype: torch.dtype):
        self.storage, self.shape, self.dtype = storage, shape, dtype


class _TensorRefPickler(pickle.Pickler):
    """Pickles _TensorRefs exactly as torch.save pickles contiguous CPU tensors."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _TensorRef):
            stride = torch.empty(obj.shape, device="meta").stride()
            args = (obj.storage, 0, obj.shape, stride, False, collections.OrderedDict())
            if serialization.pickled_as_untyped(obj.dtype):  # float8, uint16..64: bytes and the dtype
                args += (obj.dtype,)
            return serialization.tensor_rebuild_fn(obj.dtype), args
        return NotImplemented


def _storage_numel(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The size torch.save records for a tensor's storage: elements, or bytes when the storage
    is untyped (`serialization.pickled_as_untyped`)."""
    numel = math.prod(shape)
    if serialization.pickled_as_untyped(dtype):
        return numel * torch.empty((), dtype=dtype).element_size()
    return numel


class TorchArchiveWriter:
    """Writes a torch.save file of a flat {name: tensor} dict one tensor at a time: the pickle
    (from shapes and dtypes alone) first, then each tensor's record as it arrives. The bytes
    equal torch.save's (`streaming_torch_save_reason` checks that once per process)."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        refs = {
            name: _TensorRef(
                _StorageRef(serialization.pickled_storage_type(dtype), str(i), _storage_numel(dtype, shape)),
                tuple(shape),
                dtype,
            )
            for i, (name, dtype, shape) in enumerate(entries)
        }
        buf = io.BytesIO()
        _TensorRefPickler(buf, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(refs)
        alignment = serialization.storage_alignment()
        self._writer = serialization.zip_file_writer(path)
        self._next = 0
        try:
            self._record("data.pkl", buf.getvalue())
            self._record(".format_version", "1")
            if alignment is not None:
                self._record(".storage_alignment", str(alignment))
            self._record("byteorder", sys.byteorder)
        except BaseException:
            self.abort()
            raise

    def _record(self, name: str, value: Any) -> None:
        self._writer.write_record(name, value, len(value))

    def add_record(self, name: str, value: str) -> None:
        """An extra record torch.load ignores (before the first tensor)."""
        self._record(name, value)

    def add(self, tensor: torch.Tensor) -> None:
        """The next entry's data (a contiguous CPU tensor, in the order of `entries`)."""
        storage = tensor.untyped_storage()
        self._writer.write_record(f"data/{self._next}", storage, storage.nbytes())
        self._next += 1

    def close(self) -> None:
        self._writer.write_end_of_file()
        del self._writer

    def abort(self) -> None:
        """After a failed write (a full disk): end torch's zip writer without raising, so its
        destructor does not throw a second time, which ends the process (std::terminate:
        pytorch/pytorch#87997 marks the writer finalized even when ending it fails)."""
        writer = self.__dict__.pop("_writer", None)
        if writer is not None:
            try:
                writer.write_end_of_file()
            except Exception:  # noqa: BLE001 - the write's own error is what the caller sees
                pass


@functools.lru_cache(maxsize=None)
def streaming_torch_save_reason() -> str | None:
    """None when TorchArchiveWriter writes exactly torch.save's bytes on this torch; else why not."""
    import tempfile

    probe = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.arange(5, dtype=torch.bfloat16),
        "c": torch.tensor(7),
        "d": torch.zeros(0, 3, dtype=torch.int64),
    }
    for name in ("float8_e4m3fn", "uint16"):  # dtypes torch.save pickles over untyped storages
        if isinstance(getattr(torch, name, None), torch.dtype):
            probe[name] = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(getattr(torch, name))
    try:
        with tempfile.TemporaryDirectory(prefix="ckptlib-probe-") as tmp:
            mine, theirs = os.path.join(tmp, "probe.bin"), os.path.join(tmp, "ref", "probe.bin")
            os.makedirs(os.path.dirname(theirs))
            writer = TorchArchiveWriter(mine, [(k, v.dtype, tuple(v.shape)) for k, v in probe.items()])
            for value in probe.values():
                writer.add(value)
            writer.close()
            torch.save(probe, theirs)
            with open(mine, "rb") as a, open(theirs, "rb") as b:
                same = a.read() == b.read()
    except Exception as exc:  # noqa: BLE001 - any failure means "use plain torch.save"
        return f"{type(exc).__name__}: {exc}"
    return None if same else "the streamed archive differs from torch.save's"
