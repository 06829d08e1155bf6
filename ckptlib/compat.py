"""Torch feature probes and version gates. The only module that branches on torch.

Probes test for the feature itself (an attribute, an import, a signature, a behaviour)
rather than a version string, so backports and nightlies are judged by what they can do.
The supported window is torch 2.6 to the newest release; `describe()` reports every probe
(tox prints it, and ci/compat_table.py records it next to each torch version's results).

What moved or changed inside the window (2.6 .. 2.13), and how ckptlib copes:

- FSDP2 `fully_shard`: public at `torch.distributed.fsdp` (2.6+), formerly
  `torch.distributed._composable.fsdp`. On CPU it needs the `torch.cpu.Stream` stand-in to
  have `record_event`; 2.6's lacks it (`fsdp2_cpu_reason`). 2.7 cannot run three matrix
  layouts on CPU: FSDP2+TP of uneven dims, HSDP on gloo, FSDP1 with shardless ranks (`layout_gap_reason`).
- DTensor: public at `torch.distributed.tensor` (2.5+), formerly `torch.distributed._tensor`
  (`dtensor_cls`, `dtensor_api`).
- DCP: `StorageWriter.set_up_storage_writer` / `StorageReader.set_up_storage_reader` /
  `read_metadata` gained keyword arguments (rank, use_collectives) after 2.6; ckptlib's
  implementations accept and ignore extras. `_StorageInfo` gained `transform_descriptors`
  (DCP extensions) after 2.6; ckptlib reads it with getattr. `async_save` gained
  `async_checkpointer_type` / `async_stager` / `use_collectives` (`dcp_accepts`).
  `dcp.save` / `dcp.load` gained `no_dist` after 2.6 (`dcp_save_no_dist`, `dcp_load_no_dist`).
- `torch.load`: `weights_only` defaults to True from 2.6 on (and the TORCH_FORCE_*
  variables can flip it), so ckptlib always passes it explicitly; `load_weights_only_default`
  measures the effective default.
- torch.save's archive: `TorchArchiveWriter` streams a flat tensor dict through torch's own
  zip writer (`torch._C.PyTorchFileWriter`) with a pickle built from shapes alone;
  `streaming_torch_save_reason` compares its bytes with torch.save's once per process
  (export falls back to spilling tensors for torch.save where they differ).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import math
import os
import pickle
import sys
import warnings
from typing import Any, Callable

import torch

from .errors import UnsupportedError

MIN_TORCH = (2, 6)


def torch_version() -> str:
    return torch.__version__


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_torch_supported() -> None:
    if _version_tuple(torch.__version__) < MIN_TORCH:
        raise UnsupportedError(f"ckptlib needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}")


def _import_first(*candidates: tuple[str, str]) -> Any | None:
    """The first `module.attr` of `candidates` that imports, or None."""
    for module, attr in candidates:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return None


# --------------------------------------------------------------------------- FSDP2


@functools.lru_cache(maxsize=None)
def fully_shard_fn() -> Any | None:
    """FSDP2's `fully_shard`, wherever this torch keeps it, or None."""
    return _import_first(
        ("torch.distributed.fsdp", "fully_shard"),
        ("torch.distributed._composable.fsdp", "fully_shard"),
    )


def _cpu_stream_problems() -> list[str]:
    """What FSDP2's stream handling needs from `torch.cpu.Stream` (the device module of a CPU
    mesh, not `torch.Stream`) but lacks: 2.6's stand-in has no `record_event`. The method is
    called on an instance (the stand-in is a plain Python class: calling it is free)."""
    cpu = getattr(torch, "cpu", None)
    stream_cls = getattr(cpu, "Stream", None)
    if stream_cls is None:
        return ["torch.cpu.Stream is missing"]
    problems = [
        f"torch.cpu.Stream.{name} is missing"
        for name in ("record_event", "wait_event", "wait_stream")
        if not hasattr(stream_cls, name)
    ]
    if not problems:
        try:
            stream_cls().record_event()
        except Exception as exc:  # noqa: BLE001 - any failure here is FSDP2's failure too
            problems.append(f"torch.cpu.Stream().record_event() raised {type(exc).__name__}: {exc}")
    return problems


@functools.lru_cache(maxsize=None)
def fsdp2_cpu_reason() -> str | None:
    """Why FSDP2 cannot train on CPU with gloo here, or None when it can: torch 2.6's FSDP2
    calls `record_event` on `torch.cpu.Stream`, which that torch lacks (checked on the class)."""
    if fully_shard_fn() is None:
        return f"torch {torch.__version__} has no FSDP2 fully_shard"
    problems = _cpu_stream_problems()
    if problems:
        return (
            f"FSDP2 on CPU is unsupported with torch {torch.__version__}: {'; '.join(problems)} "
            "(fully_shard on CPU fails with \"'Stream' object has no attribute 'record_event'\")"
        )
    return None


def require_fsdp2_cpu() -> Any:
    reason = fsdp2_cpu_reason()
    if reason is not None:
        raise UnsupportedError(reason)
    return fully_shard_fn()


def fsdp2_reason(device_type: str = "cpu") -> str | None:
    """Why FSDP2 cannot train on `device_type` here ("cpu" or "cuda"), or None."""
    if fully_shard_fn() is None:
        return f"torch {torch.__version__} has no FSDP2 fully_shard"
    if device_type == "cpu":
        return fsdp2_cpu_reason()
    if device_type == "cuda":
        return None if torch.cuda.is_available() else f"CUDA is not available (torch {torch.__version__})"
    return f"FSDP2 on device type {device_type!r} is not covered by ckptlib's probes"


@functools.lru_cache(maxsize=None)
def fsdp1_cpu_reason() -> str | None:
    """Why FSDP1 cannot run on CPU here, or None: it needs `device_id=torch.device("cpu")` (without
    it, "FSDP needs a non-CPU accelerator device"); probed through its constructor's signature."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError as exc:
        return f"torch {torch.__version__} has no FullyShardedDataParallel: {exc}"
    if "device_id" not in inspect.signature(FullyShardedDataParallel.__init__).parameters:
        return f"torch {torch.__version__}'s FullyShardedDataParallel has no device_id argument"
    return None


@functools.lru_cache(maxsize=None)
def _source_has(module: str, qualname: str, text: str) -> bool:
    """Whether the source of torch's `module.qualname` contains `text` (False if unreadable)."""
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return text in inspect.getsource(obj)
    except (ImportError, AttributeError, OSError, TypeError):
        return False


#: layout -> (where, the code that fails, why): torch gaps that stop a matrix layout on CPU (2.7).
_LAYOUT_GAPS = {
    "fsdp2+tp": (
        "torch.distributed.fsdp._fully_shard._fsdp_param",
        "FSDPParam._init_sharded_param",
        "FSDP+TP sharding does not support uneven",
        "FSDP2 over tensor parallel refuses a dim 0 that splits unevenly",
    ),
    "hsdp": (
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
        "foreach_reduce",
        "op=ReduceOp.AVG if predivide_factor is None",
        "HSDP all-reduces gradients with ReduceOp.AVG, which gloo lacks",
    ),
    "fsdp1": (
        "torch.distributed.checkpoint.state_dict",
        "_get_model_state_dict",
        "p.is_meta",
        "get_model_state_dict asks each FSDP1 ShardedTensor is_meta, which raises 'Only single local shard "
        "is supported.' on a rank that holds no shard of it",
    ),
}


def layout_gap_reason(layout: str) -> str | None:
    """Why this torch cannot run a parallelism layout of the test matrix on CPU (probed in torch's
    source: the gap itself, not a version), or None. fsdp1-flat shares fsdp1's."""
    gap = _LAYOUT_GAPS.get("fsdp1" if layout == "fsdp1-flat" else layout)
    if gap is None or not _source_has(*gap[:3]):
        return None
    return f"torch {torch.__version__}: {gap[3]}"


def distribute_locally(tensor: torch.Tensor, mesh: Any, placements: Any) -> Any:
    """A DTensor of `tensor` (identical on every rank) cut locally, without communication:
    `distribute_tensor`'s default scatter asserts for uneven `_StridedShard` dims (FSDP2 over TP);
    `src_data_rank=None` (torch 2.6+) only splits locally."""
    from torch.distributed.tensor import distribute_tensor

    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    return distribute_tensor(tensor, mesh, placements)


def checkpoint_wrapper_fn() -> Callable[..., Any]:
    """torch's activation-checkpoint wrapper (it adds `_checkpoint_wrapped_module.` to FQNs,
    which DCP's state_dict API strips); it lives in a private module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper


# --------------------------------------------------------------------------- DTensor


def dtensor_cls() -> type | None:
    return _import_first(("torch.distributed.tensor", "DTensor"), ("torch.distributed._tensor", "DTensor"))


@functools.lru_cache(maxsize=None)
def dtensor_module_name() -> str | None:
    """Where this torch keeps DTensor: the public module (2.5+) or the private one."""
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "DTensor"):
            return name
    return None


def dtensor_api() -> Any:
    """The DTensor module (DTensor, distribute_tensor, Shard, Replicate); UnsupportedError if absent."""
    name = dtensor_module_name()
    if name is None:
        raise UnsupportedError(f"torch {torch.__version__} has no DTensor")
    return importlib.import_module(name)


def init_device_mesh_fn() -> Callable[..., Any]:
    fn = _import_first(("torch.distributed.device_mesh", "init_device_mesh"))
    if fn is None:
        raise UnsupportedError(f"torch {torch.__version__} has no torch.distributed.device_mesh.init_device_mesh")
    return fn


# --------------------------------------------------------------------------- DCP


def storage_info_cls() -> type:
    """DCP's per-item storage record; plain `dcp.load` needs exactly this class in `.metadata`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def storage_info_fields() -> tuple[str, ...]:
    """`_StorageInfo`'s fields (gained `transform_descriptors` after 2.6)."""
    import dataclasses

    cls = storage_info_cls()
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return tuple(inspect.signature(cls).parameters)


def flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """Flatten nested state dicts with DCP's own key rules (so keys match `.metadata`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def flatten_state_dict_pre_2_4(state_dict: dict) -> tuple[dict, dict]:
    """Flatten with the key rules of torch <= 2.3 (nested dicts of plain values stayed one key):
    torch 2.4 changed them (pytorch/pytorch#133923); DCP falls back to the old rules, so must we."""
    from torch.distributed.checkpoint import _version

    previous = _version._derived_version
    _version._derived_version = "2_3"
    try:
        return flatten_state_dict(state_dict)
    finally:
        _version._derived_version = previous


def set_element(root: dict, path: tuple, value: Any) -> None:
    """Put `value` at a DCP object path inside a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element as _set_element

    _set_element(root, path, value)


# torch 1.13 shipped DCP as torch.distributed._shard.checkpoint; its checkpoints' `.metadata`
# pickles the metadata classes under those module names. Today that package is a shim that
# aliases only the package, so unpickling imports a *second copy* of metadata.py whose classes
# are not DCP's ("expected BytesStorageMetadata but found ...TensorStorageMetadata").
_RENAMED_DCP_MODULES = {
    "torch.distributed._shard.checkpoint": "torch.distributed.checkpoint",
}


@functools.lru_cache(maxsize=None)
def current_pickle_module(module: str) -> str:
    """Where a class pickled under `module` by an older torch lives in this torch.

    `torch.distributed._shard.checkpoint.metadata` (1.13) -> `torch.distributed.checkpoint.metadata`,
    when this torch has the latter; any other module name is returned unchanged."""
    for old, new in _RENAMED_DCP_MODULES.items():
        if module == old or module.startswith(old + "."):
            candidate = new + module[len(old) :]
            try:
                found = importlib.util.find_spec(candidate) is not None
            except (ImportError, ValueError):
                found = False
            return candidate if found else module
    return module


def checkpoint_exception_cls() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def dcp_failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) for every rank that failed, from DCP's CheckpointException (which
    gathers failures from all ranks; each is an exception or an (exception, traceback) pair)."""
    failures = getattr(exc, "failures", None) or {}
    return [(rank, failure[0] if isinstance(failure, tuple) else failure) for rank, failure in sorted(failures.items())]


@contextlib.contextmanager
def quiet_single_process():
    """Without a process group DCP warns that it assumes one process (and, where torch.distributed
    is unavailable, that it is disabled); that is ckptlib's documented single-process mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


_DCP_FUNCTIONS = {
    "save": ("torch.distributed.checkpoint", "save"),
    "load": ("torch.distributed.checkpoint", "load"),
    "async_save": ("torch.distributed.checkpoint", "async_save"),
    "DefaultLoadPlanner": ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner"),
    "DefaultSavePlanner": ("torch.distributed.checkpoint.default_planner", "DefaultSavePlanner"),
    "FileSystemWriter": ("torch.distributed.checkpoint", "FileSystemWriter"),
    "StateDictOptions": ("torch.distributed.checkpoint.state_dict", "StateDictOptions"),
    "set_up_storage_writer": ("torch.distributed.checkpoint.storage", "StorageWriter"),
    "set_up_storage_reader": ("torch.distributed.checkpoint.storage", "StorageReader"),
    "dcp_to_torch_save": ("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save"),
}


@functools.lru_cache(maxsize=None)
def dcp_parameters(name: str) -> tuple[str, ...] | None:
    """Parameter names of a DCP entry point (see `_DCP_FUNCTIONS`), or None if it is absent."""
    module, attr = _DCP_FUNCTIONS[name]
    obj = _import_first((module, attr))
    if obj is None:
        return None
    if name in ("set_up_storage_writer", "set_up_storage_reader"):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    elif inspect.isclass(obj):
        obj = obj.__init__
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    return tuple(p for p in params if p != "self")


def dcp_accepts(name: str, argument: str) -> bool:
    """Whether DCP entry point `name` exists here and takes `argument`."""
    params = dcp_parameters(name)
    return params is not None and argument in params


def dcp_save_no_dist(state_dict: dict, *, storage_writer: Any, planner: Any = None) -> Any:
    """`dcp.save(..., no_dist=True)`: one process, no collectives, even inside a process group.
    torch 2.6's `dcp.save` lacks `no_dist`; its private `_save_state_dict` takes it everywhere."""
    import torch.distributed.checkpoint as dcp

    if dcp_accepts("save", "no_dist"):
        return dcp.save(state_dict, storage_writer=storage_writer, planner=planner, no_dist=True)
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    return _save_state_dict(state_dict, storage_writer=storage_writer, planner=planner, no_dist=True)


def dcp_load_no_dist(state_dict: dict, *, storage_reader: Any, planner: Any = None) -> None:
    """`dcp.load(..., no_dist=True)`; see `dcp_save_no_dist` (torch 2.6's `dcp.load` lacks it)."""
    import torch.distributed.checkpoint as dcp

    if dcp_accepts("load", "no_dist"):
        dcp.load(state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)
        return
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)


def create_write_items(fqn: str, obj: Any) -> list:
    """DCP's write items for one flattened state-dict value (`_create_write_items`)."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    return _create_write_items(fqn, obj)


def dedup_save_plans(plans: list, to_lowest_rank: bool) -> list:
    """DCP's dedup of replicated write items: the first step of DefaultSavePlanner's global plan."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans as dedup

    return dedup(plans, to_lowest_rank)


# --------------------------------------------------------------------------- torch.load


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


def default_store():
    """The default process group's c10d Store (the rendezvous store every rank shares)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


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


class _StorageRef:
    """A storage torch.save would write as record `data/<key>` (only its type and size known)."""

    def __init__(self, storage_type: Any, key: str, numel: int):
        self.storage_type, self.key, self.numel = storage_type, key, numel


class _TensorRef:
    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape


class _TensorRefPickler(pickle.Pickler):
    """Pickles _TensorRefs exactly as torch.save pickles contiguous CPU tensors."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _TensorRef):
            stride = torch.empty(obj.shape, device="meta").stride()
            return torch._utils._rebuild_tensor_v2, (
                obj.storage,
                0,
                obj.shape,
                stride,
                False,
                collections.OrderedDict(),
            )
        return NotImplemented


def _pickle_storage_type(dtype: torch.dtype) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, but it names the pickled type
        return getattr(torch, torch.storage.TypedStorage(0, dtype=dtype)._pickle_storage_type())


class TorchArchiveWriter:
    """Writes a torch.save file of a flat {name: tensor} dict one tensor at a time: the pickle
    (from shapes and dtypes alone) first, then each tensor's record as it arrives. The bytes
    equal torch.save's (`streaming_torch_save_reason` checks that once per process)."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        refs = {
            name: _TensorRef(_StorageRef(_pickle_storage_type(dtype), str(i), math.prod(shape)), tuple(shape))
            for i, (name, dtype, shape) in enumerate(entries)
        }
        buf = io.BytesIO()
        _TensorRefPickler(buf, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(refs)
        alignment = getattr(torch.serialization, "_get_storage_alignment", None)
        self._writer = torch._C.PyTorchFileWriter(path)
        self._record("data.pkl", buf.getvalue())
        self._record(".format_version", "1")
        if alignment is not None:
            self._record(".storage_alignment", str(alignment()))
        self._record("byteorder", sys.byteorder)
        self._next = 0

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


def has_safe_globals() -> bool:
    """`torch.serialization.safe_globals` (a context manager to allowlist classes)."""
    ser = getattr(torch, "serialization", None)
    return callable(getattr(ser, "safe_globals", None)) and callable(getattr(ser, "add_safe_globals", None))


# --------------------------------------------------------------------------- devices


def cuda_available() -> bool:
    return torch.cuda.is_available()


def nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def gloo_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


# --------------------------------------------------------------------------- report


def describe() -> dict[str, Any]:
    """Every probe's answer, JSON-serializable: for `tox`, bug reports and the compat table."""
    return {
        "torch": torch.__version__,
        "supported": _version_tuple(torch.__version__) >= MIN_TORCH,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda_available(),
        "gloo": gloo_available(),
        "nccl": nccl_available(),
        "fully_shard": None if fully_shard_fn() is None else fully_shard_fn().__module__,
        "fsdp2_cpu": fsdp2_cpu_reason() or "ok",
        "cpu_layout_gaps": {name: layout_gap_reason(name) or "ok" for name in _LAYOUT_GAPS},
        "dtensor_module": dtensor_module_name(),
        "storage_info_fields": list(storage_info_fields()),
        "load_planner_allow_partial_load": dcp_accepts("DefaultLoadPlanner", "allow_partial_load"),
        "dcp_no_dist": dcp_accepts("save", "no_dist") and dcp_accepts("load", "no_dist"),
        "async_save": dcp_parameters("async_save") is not None,
        "async_save_stager": dcp_accepts("async_save", "async_stager"),
        "storage_writer_setup": list(dcp_parameters("set_up_storage_writer") or ()),
        "dcp_to_torch_save": dcp_parameters("dcp_to_torch_save") is not None,
        "torch_load_weights_only_default": load_weights_only_default(),
        "meta_load_records_offsets": meta_load_records_offsets(),
        "zip_writer_without_crc": torch_save_without_zip_crc(torch.zeros(1), io.BytesIO()),
        "safe_globals": has_safe_globals(),
        "dcp_1_13_metadata_module": current_pickle_module("torch.distributed._shard.checkpoint.metadata"),
    }
