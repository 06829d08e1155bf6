"""Leaving a process group safely: `exit_barrier()` before `destroy_process_group()` or exit."""

from __future__ import annotations

import torch.distributed as dist

from ckptlib._runtime import world as _world
from ckptlib._runtime.agree import is_distributed
from ckptlib._torch import c10d
from ckptlib.errors import CheckpointError

_exit_barriers = 0


def _forget_world() -> None:
    """A new world's store has none of the old one's barrier keys: count from the start again."""
    global _exit_barriers
    _exit_barriers = 0


_world.on_new_world(_forget_world)


def exit_barrier(timeout_s: float = 300.0, key: str | None = None, group=None) -> None:
    """Wait, through the rendezvous store, until every rank is done with collectives.

    Tearing a gloo group down (or exiting) while a peer still reads the last collective's
    bytes makes that peer abort ("Connection closed by peer", or "terminate called without
    an active exception"); a store-based barrier before that avoids the race. Call it on
    every rank before `destroy_process_group()` or exit. Rank 0, which usually hosts the
    store, leaves last, so no rank polls a store that is gone. Every call of a process uses
    its own store key (`key`, or the n-th call's), so ranks must call it equally often.
    `group`: only its ranks take part (its rank 0 leaves last).
    """
    global _exit_barriers
    if not is_distributed():
        return
    import time

    _world.generation()
    if key is None:
        _exit_barriers += 1
        key = f"ckptlib/exit_barrier/{_exit_barriers}"
    store = c10d.default_store()
    world = dist.get_world_size(group)

    def wait_for(name: str, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while int(store.add(name, 0)) < world:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"exit barrier: only {int(store.add(name, 0))} of {world} ranks {what} in {timeout_s:.0f}s"
                )
            time.sleep(0.01)

    store.add(key, 1)
    wait_for(key, "arrived")
    store.add(f"{key}/left", 1)
    if dist.get_rank(group) == 0:
        wait_for(f"{key}/left", "left")
