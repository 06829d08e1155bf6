"""torch.load's and torch.save's internals as ckptlib uses them.

- `torch.load`: `weights_only` defaults to True from 2.6 on (and the TORCH_FORCE_* variables can
  flip it), so ckptlib always passes it explicitly; `load_weights_only_default` measures the
  effective default. A metadata-only load tells where a tensor's bytes lie only on newer torch
  (`meta_storage_offset`).
- `torch.save`: its zip writer (`torch._C.PyTorchFileWriter`) and the names its pickle uses,
  for the item encoder (`torch_save_without_zip_crc`) and the streaming archive writer
  (`ckptlib.format.foreign.torch_archive`), which write torch.save's exact bytes their own way;
  `watch_path_saves` shows the crash harness a torch.save to a path (its C++ writer's file).
"""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from typing import Any, Callable

import torch


class _NotAllowlisted:
    """A class no weights_only unpickler allows: loading it tells which default is in force."""


@functools.lru_cache(maxsize=None)
def load_weights_only_default() -> bool:
    """Whether a bare `torch.load(f)` unpickles with weights_only=True here (2.6+, unless
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD); measured for reports: ckptlib always passes it."""
    buf = io.BytesIO()
    torch.save({"probe": _NotAllowlisted()}, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    buf.seek(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.load(buf)
    except pickle.UnpicklingError:
        return True
    except Exception:  # noqa: BLE001 - another failure still means "restricted"
        return True
    return False


@functools.lru_cache(maxsize=None)
def meta_load_records_offsets() -> bool:
    """Whether `torch.load(..., map_location="meta")` tells where each storage's bytes lie in
    the file (`untyped_storage()._checkpoint_offset`), which CkptReader's zero-copy read of
    local tensor items needs. Measured: torch 2.13 does, 2.9.1 and 2.6 do not (the reader
    then takes its generic path: same results, one more copy)."""
    buf = io.BytesIO()
    torch.save(torch.arange(4, dtype=torch.float32), buf)
    buf.seek(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = torch.load(buf, map_location="meta", weights_only=True)
        return isinstance(meta_storage_offset(meta), int)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def meta_storage_offset(meta: torch.Tensor) -> int | None:
    """Where the bytes of a tensor loaded with `map_location="meta"` lie in its archive, or
    None where this torch does not record it (see `meta_load_records_offsets`)."""
    return getattr(meta.untyped_storage(), "_checkpoint_offset", None)


def has_safe_globals() -> bool:
    """`torch.serialization.safe_globals` (a context manager to allowlist classes)."""
    ser = getattr(torch, "serialization", None)
    return callable(getattr(ser, "safe_globals", None)) and callable(getattr(ser, "add_safe_globals", None))


def storage_alignment() -> int | None:
    """The storage alignment torch.save records in `.storage_alignment` (2.7+), or None where
    this torch writes no such record."""
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    return None if alignment is None else alignment()


def zip_file_writer(path: str) -> Any:
    """torch.save's own zip writer (`torch._C.PyTorchFileWriter`) on a new file at `path`."""
    return torch._C.PyTorchFileWriter(path)


def pickled_as_untyped(dtype: torch.dtype) -> bool:
    """Whether torch.save pickles tensors of `dtype` over a plain UntypedStorage (of bytes) and
    rebuilds them with `_rebuild_tensor_v3`, naming the dtype: float8, uint16/32/64, complex32
    and other dtypes that have no typed storage class (`torch.storage._new_dtypes`)."""
    new_dtypes = getattr(torch.storage, "_new_dtypes", None)
    return new_dtypes is not None and dtype in new_dtypes()


def pickled_storage_type(dtype: torch.dtype) -> Any:
    """The storage class torch.save's pickle names for tensors of `dtype` (e.g. FloatStorage;
    UntypedStorage for `pickled_as_untyped` dtypes)."""
    if pickled_as_untyped(dtype):
        return torch.UntypedStorage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, but it names the pickled type
        return getattr(torch, torch.storage.TypedStorage(0, dtype=dtype)._pickle_storage_type())


def tensor_rebuild_fn(dtype: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
    """The function torch.save's pickle calls to rebuild a plain tensor of `dtype`:
    `_rebuild_tensor_v2`, or `_rebuild_tensor_v3` (which also takes the dtype) for the
    `pickled_as_untyped` dtypes."""
    if dtype is not None and pickled_as_untyped(dtype):
        return torch._utils._rebuild_tensor_v3
    return torch._utils._rebuild_tensor_v2


def torch_save_without_zip_crc(obj: Any, buffer: Any) -> bool:
    """torch.save `obj` into `buffer` with the zip writer's CRC-32 pass off (its fields are
    left zero for the caller to fill in, see `format.item_encoder`); False where this torch
    cannot (then nothing was written). Uses torch's own writer rather than the global
    `set_crc32_options`, which would also change other threads' torch.save calls."""
    writer_cls = getattr(torch._C, "PyTorchFileWriter", None)
    save_impl = getattr(torch.serialization, "_save", None)
    if writer_cls is None or save_impl is None:
        return False
    alignment = getattr(torch.serialization, "_get_storage_alignment", None)
    try:
        if alignment is not None:  # 2.7+: (buffer, compute_crc32, storage_alignment)
            writer = writer_cls(buffer, False, alignment())
        else:  # 2.6: (buffer, compute_crc32)
            writer = writer_cls(buffer, False)
    except TypeError:
        return False
    save_impl(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    return True


def watch_path_saves(before: Callable[[str, str], None]) -> Callable[[], None] | None:
    """Make `torch.save(obj, path)` visible to the crash harness: its C++ zip writer opens and
    writes `path` itself, past every Python-level hook. `before("open", path)` runs before the
    writer opens the file, `before("close", path)` before it writes the archive's end. Returns
    the function that undoes it, or None where this torch has no `_open_zipfile_writer`."""
    serialization = torch.serialization
    real = getattr(serialization, "_open_zipfile_writer", None)
    is_path = getattr(serialization, "_is_path", None)
    if real is None or is_path is None:
        return None

    class _Watched:
        def __init__(self, opener: Any, path: str):
            self._opener = opener
            self._path = path

        def __enter__(self):
            return self._opener.__enter__()

        def __exit__(self, *exc):
            if exc[0] is None:
                before("close", self._path)
            return self._opener.__exit__(*exc)

    def open_zipfile_writer(name_or_buffer):
        if not is_path(name_or_buffer):
            return real(name_or_buffer)
        path = str(name_or_buffer)
        before("open", path)
        return _Watched(real(name_or_buffer), path)

    serialization._open_zipfile_writer = open_zipfile_writer

    def undo() -> None:
        serialization._open_zipfile_writer = real

    return undo
