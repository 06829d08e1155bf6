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
    store, leaves last, so no rank waits on a store that is gone. Every call of a process uses
    its own store key (`key`, or the n-th call's), so ranks must call it equally often.
    `group`: only its ranks take part (its rank 0 leaves last).

    Store operations per rank, whatever the group's size: one increment and one blocking wait
    on a key the last rank in sets (the last one sets it instead of waiting); then one more
    increment, the last rank out setting the key rank 0 waits on: at most four, nothing polled.
    """
    global _exit_barriers
    if not is_distributed():
        return
    import datetime
    import time

    _world.generation()
    if key is None:
        _exit_barriers += 1
        key = f"ckptlib/exit_barrier/{_exit_barriers}"
    store = c10d.default_store()
    world = dist.get_world_size(group)
    deadline = time.monotonic() + timeout_s

    def wait_for(name: str, count: int, what: str) -> None:
        try:
            store.wait([f"{name}/all"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:  # noqa: BLE001 - a timeout: say how many came
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
            raise CheckpointError(
                f"exit barrier: only {int(store.add(name, 0))} of {count} ranks {what} in {timeout_s:.0f}s"
            ) from None

    if int(store.add(key, 1)) >= world:
        store.set(f"{key}/all", "1")
    else:
        wait_for(key, world, "arrived")
    if int(store.add(f"{key}/left", 1)) >= world:
        store.set(f"{key}/left/all", "1")
    elif dist.get_rank(group) == 0:
        wait_for(f"{key}/left", world, "left")
