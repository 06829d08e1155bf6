"""Torch feature probes and version gates. The only module that branches on torch.

Probes test for the feature itself (an attribute, an import) rather than a version
string, so backports and nightlies are judged by what they can do.
"""

from __future__ import annotations

import functools
from typing import Any

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
        raise UnsupportedError(
            f"ckptlib needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}"
        )


@functools.lru_cache(maxsize=None)
def fully_shard_fn() -> Any | None:
    """FSDP2's `fully_shard`, wherever this torch keeps it, or None."""
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard

        return fully_shard
    except ImportError:
        return None


def fsdp2_cpu_reason() -> str | None:
    """Why FSDP2 cannot train on CPU with gloo here, or None when it can.

    torch 2.6's FSDP2 calls `Stream.record_event` in its CPU path, which that torch's
    `torch.Stream` lacks ("'Stream' object has no attribute 'record_event'").
    """
    if fully_shard_fn() is None:
        return f"torch {torch.__version__} has no FSDP2 fully_shard"
    if not hasattr(torch.Stream, "record_event"):
        return (
            f"FSDP2 on CPU needs torch.Stream.record_event, missing in torch {torch.__version__} "
            "(fully_shard on CPU fails with \"'Stream' object has no attribute 'record_event'\")"
        )
    return None


def require_fsdp2_cpu() -> Any:
    reason = fsdp2_cpu_reason()
    if reason is not None:
        raise UnsupportedError(reason)
    return fully_shard_fn()


def storage_info_cls() -> type:
    """DCP's per-item storage record; plain `dcp.load` needs exactly this class in `.metadata`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def flatten_state_dict(state_dict: dict) -> tuple[dict, dict]:
    """Flatten nested state dicts with DCP's own key rules (so keys match `.metadata`)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def set_element(root: dict, path: tuple, value: Any) -> None:
    """Put `value` at a DCP object path inside a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element as _set_element

    _set_element(root, path, value)


def checkpoint_exception_cls() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def cuda_available() -> bool:
    return torch.cuda.is_available()


def dtensor_cls() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor
