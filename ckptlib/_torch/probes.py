"""Small feature probes shared by the rest of `_torch` and by ckptlib: the supported window,
where this torch keeps DTensor, and which devices and process-group backends it has."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

MIN_TORCH = (2, 6)


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.13.0+cpu" or "2.14.0a0"."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def import_first(*candidates: tuple[str, str]) -> Any | None:
    """The first `module.attr` of `candidates` that imports, or None."""
    for module, attr in candidates:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return None


def dtensor_cls() -> type | None:
    """DTensor: public at `torch.distributed.tensor` (2.5+), formerly `torch.distributed._tensor`."""
    return import_first(("torch.distributed.tensor", "DTensor"), ("torch.distributed._tensor", "DTensor"))


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


def cuda_available() -> bool:
    return torch.cuda.is_available()


def nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def gloo_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())
