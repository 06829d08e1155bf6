"""Collective helpers that make one rank's failure an error on every rank, never a hang.

Every decision that could differ between ranks (does the path exist, is the checkpoint
committed, did my shard write succeed) goes through `agree` or `decide_on_rank0`, so all
ranks either continue together or raise the same ckptlib error together. Without a
process group every helper degrades to a plain local call.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from .errors import CheckpointError

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def barrier(group=None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def _as_checkpoint_error(exc: BaseException, rank: int) -> CheckpointError:
    """Keep ckptlib errors as they are; wrap anything else so its type and rank survive."""
    if isinstance(exc, CheckpointError):
        if exc.rank is None:
            exc.rank = rank
        return exc
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return CheckpointError(f"rank {rank}: {detail}", rank=rank)


def portable_error(exc: BaseException, rank: int) -> CheckpointError:
    """An exception that is safe to pickle to other ranks."""
    err = _as_checkpoint_error(exc, rank)
    try:
        import pickle

        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return CheckpointError(f"rank {rank}: {err}", rank=rank)


def _flag_device(group) -> torch.device:
    """Where a collective's tensor must live for this group's backend (NCCL: the current GPU)."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(fn: Callable[[], T], group=None) -> T:
    """Run `fn` on every rank; if it raised on any rank, raise on every rank.

    Every rank raises a CheckpointError: the failing rank its own (chained to the original
    exception), the others the first failing rank's, which names that rank.
    """
    result: Any = None
    local_error: BaseException | None = None
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
        if not is_distributed() or isinstance(exc, KeyboardInterrupt):
            raise
        local_error = exc
    if not is_distributed():
        return result
    # The common case, nobody failed, costs one tiny all_reduce; the errors themselves are
    # gathered (two more rounds: sizes, then payloads) only when some rank failed.
    failed = torch.tensor([0 if local_error is None else 1], dtype=torch.int32, device=_flag_device(group))
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return result
    portable = None if local_error is None else portable_error(local_error, dist.get_rank())
    gathered: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(gathered, portable, group=group)
    if local_error is not None:
        if portable is local_error:
            raise local_error
        raise portable from local_error
    for err in gathered:
        if err is not None:
            raise err
    return result


def decide_on_rank0(fn: Callable[[], T], group=None) -> T:
    """Run `fn` on group rank 0 only and hand its result (or its error) to every rank."""
    if not is_distributed():
        return fn()
    payload: list[Any] = [None]
    if get_rank(group) == 0:
        try:
            payload[0] = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
            payload[0] = ("error", portable_error(exc, dist.get_rank()))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(payload, src=src, group=group)
    status, value = payload[0]
    if status == "error":
        raise value
    return value
