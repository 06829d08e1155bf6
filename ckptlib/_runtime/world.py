"""The torch.distributed world that ckptlib's per-process caches belong to.

A process may leave its world (`destroy_process_group()`) and join another
(`init_process_group()` on a new store): an elastic restart inside the process, a test. Every
group torch made in the old world is then dead (torch: "not initialized in the world group
map"), and so is what ckptlib keeps for that world: the dedicated gloo groups of async saves
(`saving.background_save`) and of a load's shared reads (`loading.read_exchange`), staging kept
for groups of the old world, the check-in and roll-call serials and the heartbeat
(`_runtime.agree`: keys and a thread in the old store), the exit barrier's serial
(`_runtime.teardown`), the cluster tier's topology (`manager.cluster.cluster_tier`).

`generation()` tells which world this is: it changes when the default group is another object
than the one seen last, and then, before it returns, every `on_new_world` reset runs, so each
cache that asks it before use starts the new world empty (and its serials at 0, where a
process that joins the world starts them too). What outlives a world on purpose: the plan
caches (`format.write.plan_cache`: their fingerprint holds the group's ranks and this rank,
their token is agreed again in every save's round), the writer process (bound to no group),
the staging of the default group (memory, reused by the next save).

`check_group(group, ...)`: a group of a dead world passed to a public call (or kept by a
CheckpointManager made before the restart) is a ProcessGroupError, not torch's ValueError.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import torch.distributed as dist

from ckptlib.errors import ProcessGroupError

_lock = threading.Lock()
_seen: "weakref.ref | None" = None  # the default group of the world seen last
_generation = 0
_resets: list[Callable[[], None]] = []


def _default_group():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD


def generation() -> int:
    """The number of the world this process is in (0: the first one it saw, or none yet); a
    new world runs every `on_new_world` reset first, once, in the thread that sees it first."""
    global _seen, _generation
    current = _default_group()
    with _lock:
        last = None if _seen is None else _seen()
        if current is None or current is last:
            return _generation  # no world now: the old one's caches go when a new one is seen
        new = _seen is not None  # the first world seen resets nothing (nothing was kept before it)
        _seen = weakref.ref(current)
        if new:
            _generation += 1
        resets = list(_resets) if new else []
        number = _generation
    for reset in resets:
        reset()
    return number


def on_new_world(reset: Callable[[], None]) -> Callable[[], None]:
    """Register `reset` (drop what belongs to the old world) to run when a new world is seen."""
    with _lock:
        _resets.append(reset)
    return reset


def check_group(group, what: str) -> None:
    """ProcessGroupError (naming `what` and this rank) when `group` is not a group of this
    process's current world: destroyed, or made before `destroy_process_group()`; or given
    while no world is initialized at all."""
    if group is None:
        return
    if _default_group() is None:
        raise ProcessGroupError(
            f"{what}: a process group was passed, but torch.distributed is not initialized in this process "
            "(destroy_process_group() was called); call init_process_group() and pass a group of the new world"
        )
    generation()
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        rank = dist.get_rank()
        raise ProcessGroupError(
            f"{what} on rank {rank}: its process group is not part of this process's torch.distributed world "
            "(destroyed, or made before destroy_process_group()); pass a group of the current world "
            "(a CheckpointManager keeps the group it was made with: make a new one)",
            rank=rank,
        ) from None


__all__ = ["check_group", "generation", "on_new_world"]
