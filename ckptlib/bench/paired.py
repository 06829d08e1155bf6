"""Robust numbers on a shared machine, for `ckpt bench`: repetitions summarized as median and
min-max, ckptlib against its ceiling as the median of per-repetition (ABAB) ratios, and each
timed operation's CPU time, run-queue wait and the load average, so a row measured while the
process was starved of CPU is flagged instead of trusted.

Wall time on a loaded machine mostly measures the other processes; CPU time and the time the
measuring thread spent runnable but waiting for a core (`/proc/thread-self/schedstat`, Linux)
say how much of it was this process's own work and how much was contention.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Sequence

#: A row is "starved" when its operations spent at least this share of their wall time
#: runnable but waiting for a CPU (run-queue wait / wall, median over the repetitions) ...
STARVED_RUNQ_SHARE = 0.25
#: ... or, for a CPU-bound measurement (memory copy), when CPU time / wall falls below this
#: fraction of the threads it runs (a single-threaded copy below 0.7 was not on a core 30% of the time).
STARVED_CPU_SHARE = 0.7


def nan() -> float:
    return float("nan")


def spread(values: Sequence[float]) -> dict[str, Any]:
    """{"median", "min", "max", "n"} of the finite `values` (NaN and None are left out)."""
    finite = [float(v) for v in values if v is not None and v == v and v not in (float("inf"), float("-inf"))]
    if not finite:
        return {"median": nan(), "min": nan(), "max": nan(), "n": 0}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite), "n": len(finite)}


def pair_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """The ratio of each repetition's pair (numerator[i] / denominator[i]); a pair with a
    missing or zero denominator gives NaN. Pairs beyond the shorter list are dropped."""
    out = []
    for a, b in zip(numerator, denominator):
        out.append(a / b if (a is not None and b and a == a and b == b) else nan())
    return out


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """`spread` of the per-repetition ratios: the median of ratios measured side by side,
    which machine noise between repetitions does not move the way a ratio of medians does."""
    return spread(pair_ratios(numerator, denominator))


def throughputs(nbytes: int, seconds: Sequence[float]) -> list[float]:
    """MiB/s for each time in `seconds` (NaN for a zero or missing time)."""
    return [(nbytes / (1 << 20)) / s if s and s == s else nan() for s in seconds]


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def runqueue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat;
    None elsewhere). The calling thread is the one that runs the timed operation; a pool's
    workers wait on it, so its wait is the operation's."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            fields = f.read().split()
    except OSError:
        return None
    return int(fields[1]) / 1e9 if len(fields) >= 2 else None


def sample() -> tuple[float, float, float | None]:
    """(wall, process CPU, run-queue wait) now, for `usage` of what happens until the next sample."""
    return time.perf_counter(), time.process_time(), runqueue_seconds()


def usage(start: tuple[float, float, float | None], end: tuple[float, float, float | None]) -> dict[str, float]:
    """Wall seconds, CPU seconds and run-queue seconds between two `sample`s."""
    wall = end[0] - start[0]
    runq = end[2] - start[2] if start[2] is not None and end[2] is not None else nan()
    return {"wall_s": wall, "cpu_s": end[1] - start[1], "runq_s": max(0.0, runq) if runq == runq else runq}


def measured(fn: Callable[[], Any]) -> dict[str, float]:
    """Run `fn()` and return its `usage`."""
    start = sample()
    fn()
    return usage(start, sample())


def shares(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median CPU / wall and run-queue wait / wall over repetitions' `usage` dicts."""
    cpu = [s["cpu_s"] / s["wall_s"] for s in samples if s.get("wall_s")]
    runq = [s["runq_s"] / s["wall_s"] for s in samples if s.get("wall_s") and s.get("runq_s") == s.get("runq_s")]
    return {"cpu_per_wall": spread(cpu)["median"], "runq_per_wall": spread(runq)["median"]}


def starved(share: dict[str, float], cpu_bound_threads: int = 0) -> bool:
    """Whether a row's operations were starved of CPU: run-queue wait at least
    STARVED_RUNQ_SHARE of the wall, or, for a CPU-bound measurement on `cpu_bound_threads`
    threads, CPU time below STARVED_CPU_SHARE of what those threads could have run."""
    runq = share.get("runq_per_wall", nan())
    if runq == runq and runq >= STARVED_RUNQ_SHARE:
        return True
    cpu = share.get("cpu_per_wall", nan())
    return bool(cpu_bound_threads) and cpu == cpu and cpu < STARVED_CPU_SHARE * cpu_bound_threads
