"""In-rank body of `ckpt bench`'s resharded loads: the checkpoints saved at every world size N,
loaded into this world size M, interleaved."""

from __future__ import annotations

from typing import Any

from .rank_ops import make_state, rank_world, timed, warm


def rank_reshard(sources: dict[int, str], size_mib: int, reps: int, verify_modes: list[bool]) -> dict[str, Any]:
    """Loads of checkpoints saved at every N into this world size M, interleaved."""
    import ckptlib

    rank, world = rank_world()
    template = make_state(size_mib, fill=False)
    times: dict[str, list[float]] = {}
    keys = sorted(sources)
    for rep in range(reps):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for n in order:
            for verify in verify_modes:
                warm(sources[n])
                seconds = timed(lambda: ckptlib.load(sources[n], template, verify=verify))
                times.setdefault(f"{n}:{int(verify)}", []).append(seconds)
    return {"rank": rank, "world": world, "times": times}
