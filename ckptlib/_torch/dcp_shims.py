"""torch.distributed.checkpoint (DCP) as ckptlib calls it: its private helpers behind stable
names, and its entry points' signatures probed rather than assumed.

What changed inside the window (2.6 .. newest): `StorageWriter.set_up_storage_writer` /
`StorageReader.set_up_storage_reader` / `read_metadata` gained keyword arguments (rank,
use_collectives) after 2.6, which ckptlib's implementations accept and ignore; `_StorageInfo`
gained `transform_descriptors` (DCP extensions) after 2.6, which ckptlib reads with getattr;
`async_save` gained `async_checkpointer_type` / `async_stager` / `use_collectives`, and
`dcp.save` / `dcp.load` gained `no_dist` (`dcp_accepts`, `dcp_save_no_dist`, `dcp_load_no_dist`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import warnings
from typing import Any

from ckptlib._torch.probes import import_first


def storage_info_cls() -> type:
    """DCP's per-item storage record; plain `dcp.load` needs exactly this class in `.metadata`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def storage_info_fields() -> tuple[str, ...]:
    """`_StorageInfo`'s fields (gained `transform_descriptors` after 2.6)."""
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


def create_write_items(fqn: str, obj: Any) -> list:
    """DCP's write items for one flattened state-dict value (`_create_write_items`)."""
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    return _create_write_items(fqn, obj)


def dedup_save_plans(plans: list, to_lowest_rank: bool) -> list:
    """DCP's dedup of replicated write items: the first step of DefaultSavePlanner's global plan."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans as dedup

    return dedup(plans, to_lowest_rank)


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
    obj = import_first((module, attr))
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
