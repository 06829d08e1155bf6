"""In-rank body of `ckpt bench`'s resharded loads: the checkpoints saved at every world size N,
loaded into this world size M, interleaved (so each repetition pairs every N -> M load with the
same-N M -> M one)."""

from __future__ import annotations

from typing import Any

from ckptlib.bench.rank_ops import make_state, rank_world, timed_use, warm


def rank_reshard(sources: dict[int, str], size_mib: int, reps: int, verify_modes: list[bool]) -> dict[str, Any]:
    """Loads of checkpoints saved at every N into this world size M, interleaved."""
    import ckptlib

    rank, world = rank_world()
    template = make_state(size_mib, fill=False)
    times: dict[str, list[float]] = {}
    uses: dict[str, list[dict[str, float]]] = {}
    keys = sorted(sources)
    for rep in range(-1, reps):  # round -1: an untimed warm-up
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for n in order:
            for verify in verify_modes:
                warm(sources[n])
                use = timed_use(lambda: ckptlib.load(sources[n], template, verify=verify))
                if rep >= 0:
                    times.setdefault(f"{n}:{int(verify)}", []).append(use["wall_s"])
                    uses.setdefault(f"{n}:{int(verify)}", []).append(use)
    return {"rank": rank, "world": world, "times": times, "usage": uses}
