"""Gates for the parallelism layouts of the test matrix (`ckptlib.testing`): whether FSDP,
FSDP2, DTensor and device meshes run here, and how to build them on this torch.

What moved or changed inside the window (2.6 .. newest): FSDP2's `fully_shard` is public at
`torch.distributed.fsdp` (2.6+), formerly `torch.distributed._composable.fsdp`; on CPU it needs
the `torch.cpu.Stream` stand-in to have `record_event`, which 2.6's lacks (`fsdp2_cpu_reason`).
2.7 cannot run three matrix layouts on CPU: FSDP2+TP of uneven dims, HSDP on gloo, FSDP1 with
shardless ranks (`layout_gap_reason`). DTensor is public at `torch.distributed.tensor` (2.5+),
formerly `torch.distributed._tensor` (`ckptlib._torch.probes.dtensor_module_name`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch

from ckptlib._torch.probes import import_first
from ckptlib.errors import UnsupportedError


@functools.lru_cache(maxsize=None)
def fully_shard_fn() -> Any | None:
    """FSDP2's `fully_shard`, wherever this torch keeps it, or None."""
    return import_first(
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
    """FSDP2's `fully_shard` for a CPU mesh; UnsupportedError with the reason where it cannot run."""
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
LAYOUT_GAPS = {
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
    gap = LAYOUT_GAPS.get("fsdp1" if layout == "fsdp1-flat" else layout)
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


def local_tensor(dtensor: Any) -> torch.Tensor:
    """A DTensor's local shard without `to_local()`'s autograd call (~9 us a tensor): the
    plan cache's fingerprint reads only its dtype and flags."""
    local = getattr(dtensor, "_local_tensor", None)
    return dtensor.to_local() if local is None else local


def checkpoint_wrapper_fn() -> Callable[..., Any]:
    """torch's activation-checkpoint wrapper (it adds `_checkpoint_wrapped_module.` to FQNs,
    which DCP's state_dict API strips); it lives in a private module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper


def init_device_mesh_fn() -> Callable[..., Any]:
    """`init_device_mesh`; UnsupportedError where this torch has no device meshes."""
    fn = import_first(("torch.distributed.device_mesh", "init_device_mesh"))
    if fn is None:
        raise UnsupportedError(f"torch {torch.__version__} has no torch.distributed.device_mesh.init_device_mesh")
    return fn
