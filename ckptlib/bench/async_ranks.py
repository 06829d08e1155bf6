"""What one rank of `ckpt bench async` (`async_modes`) does: its state, the two training loops, the
memory meter, and the phases (first save, staging memory, step time), inside ranks started
by `ckptlib.testing.launch` (a gloo group is initialised)."""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from typing import Any

from ckptlib.bench.rank_ops import barrier, rank_world

MODES = ("none", "thread", "process")
SAVE_MODES = ("thread", "process")
LOOPS = ("cpu", "io")


def rotated(items: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """`items` starting at position `rep` (the interleaving order of a repetition)."""
    k = rep % len(items)
    return items[k:] + items[:k]


def make_state(mib: int, tensors: int) -> dict[str, Any]:
    """This rank's shard: `tensors` float32 DTensors (Shard(0) over the ranks) of `mib` MiB a
    rank in all, seeded by rank, plus a step counter."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (world,))
    per = max(1, (mib << 20) // 4 // tensors)
    gen = torch.Generator().manual_seed(rank)
    params = {
        f"t{i}": DTensor.from_local(torch.rand(per, generator=gen), mesh, [Shard(0)], run_check=False)
        for i in range(tensors)
    }
    return {"params": params, "step": 0}


def shard_bytes(state: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * 4 for t in state["params"].values())


class CpuLoop:
    """A CPU-bound step: `ops` rounds of `x = tanh(x @ w)` on a (64, width) activation (1 thread;
    part of it in Python, so it needs the GIL)."""

    def __init__(self, width: int, ops: int):
        import torch

        gen = torch.Generator().manual_seed(1)
        self.w = torch.randn(width, width, generator=gen) / width**0.5
        self.x0 = torch.randn(64, width, generator=gen)
        self.ops = ops

    def step(self) -> float:
        import torch

        started = time.perf_counter()
        x = self.x0
        for _ in range(self.ops):
            x = torch.tanh(x @ self.w)
        float(x.sum())
        return time.perf_counter() - started


class IoLoop(CpuLoop):
    """An I/O-light step, as a GPU-bound step looks from the host: a few launches' worth of
    Python and compute (`ops` rounds), then waiting `wait_ms` (the device) with the GIL released."""

    def __init__(self, width: int, ops: int, wait_ms: float):
        super().__init__(width, ops)
        self.wait_s = wait_ms / 1e3

    def step(self) -> float:
        started = time.perf_counter()
        super().step()
        time.sleep(self.wait_s)
        return time.perf_counter() - started


def _status_kib(pid: int | str, fields: tuple[str, ...]) -> int:
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    total += int(value.split()[0])
    except OSError:
        return 0
    return total


def resident_bytes() -> int:
    """The rank's resident bytes (VmRSS, its shared-memory staging included) plus its writer
    process's own (RssAnon + RssFile: the staging it maps is not counted twice)."""
    from ckptlib.saving import writer_process

    total = _status_kib("self", ("VmRSS",))
    writer = writer_process.current()
    if writer is not None and writer.pid is not None and writer.process is not None:
        total += _status_kib(writer.pid, ("RssAnon", "RssFile"))
    return total * 1024


class Meter:
    """The peak of `resident_bytes()`, sampled every `period` s by a thread while in a `with`."""

    def __init__(self, period: float = 0.02):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Meter":
        self.peak = resident_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-meter", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def _first_saves(cfg: dict[str, Any], state: dict, scratch: str) -> dict[str, list[dict[str, float]]]:
    """Per save mode, `first_reps` times (modes interleaved): from a cold start (no writer, no
    staging buffers) the seconds from `CheckpointManager(async_save=...)` to the first save
    committed, and the peak resident bytes on the way (and over the rank before it)."""
    import ckptlib
    from ckptlib.saving import background_save

    out: dict[str, list[dict[str, float]]] = {m: [] for m in SAVE_MODES}
    for rep in range(cfg["first_reps"]):
        for mode in rotated(SAVE_MODES, rep):
            background_save.release_staging()
            root = os.path.join(scratch, f"first-{mode}")
            barrier()
            before = resident_bytes()
            with Meter() as meter:
                started = time.perf_counter()
                manager = ckptlib.CheckpointManager(root, keep_last=1, async_save=ckptlib.AsyncMode(mode))
                manager.save(rep + 1, state)
                manager.wait()
                seconds = time.perf_counter() - started
            manager.close()
            out[mode].append({"seconds": seconds, "peak": meter.peak, "over": meter.peak - before})
    barrier()
    return out


def _timed(mode: str, loop: CpuLoop, state: dict, target: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of `loop` with no save, or while an async save of `mode` runs."""
    import ckptlib

    if mode == "none":
        return {"steps": [loop.step() for _ in range(cfg["none_steps"])]}
    handle = ckptlib.async_save(target, state, step=int(state["step"]), async_mode=mode)
    times = []
    while not handle.done() or len(times) < cfg["min_steps"]:
        times.append(loop.step())
    result = handle.wait()
    return {"steps": times, "blocking": handle.blocking_seconds, "save": result.seconds}


def _steps(cfg: dict[str, Any], state: dict, scratch: str) -> list[dict[str, Any]]:
    """`reps` repetitions; in each, per loop, no save / thread / process in a rotating order
    (one untimed save per mode first: the writer runs and the staging buffers are filled)."""
    import ckptlib

    loops = {"cpu": CpuLoop(cfg["width"], cfg["ops"]), "io": IoLoop(cfg["width"], cfg["io_ops"], cfg["io_wait_ms"])}
    for loop in loops.values():
        loop.step()
    for mode in SAVE_MODES:
        ckptlib.async_save(os.path.join(scratch, f"warm-{mode}"), state, async_mode=mode).wait()
    reps = []
    for rep in range(cfg["reps"]):
        state["step"] = rep + 1
        runs: dict[str, dict[str, Any]] = {}
        for name, loop in loops.items():
            runs[name] = {}
            for mode in rotated(MODES, rep):
                barrier()
                target = os.path.join(scratch, f"{name}-{mode}-{rep}")
                runs[name][mode] = _timed(mode, loop, state, target, cfg)
        barrier()
        if rep < cfg["reps"] - 1 and rank_world()[0] == 0:
            for name in loops:
                for mode in SAVE_MODES:
                    shutil.rmtree(os.path.join(scratch, f"{name}-{mode}-{rep}"), ignore_errors=True)
        reps.append(runs)
    return reps


def _same_after_load(cfg: dict[str, Any], state: dict, scratch: str) -> bool:
    """Whether the last step-phase checkpoint of each save mode loads back bit-exactly."""
    import torch

    import ckptlib

    ok = True
    last = cfg["reps"] - 1
    for mode in SAVE_MODES:
        got = make_state(cfg["mib"], cfg["tensors"])
        for value in got["params"].values():
            value.to_local().zero_()
        ckptlib.load(os.path.join(scratch, f"cpu-{mode}-{last}"), got)
        ok = ok and got["step"] == last + 1
        ok = ok and all(torch.equal(got["params"][k].to_local(), v.to_local()) for k, v in state["params"].items())
    return ok


def _staging_memory(cfg: dict[str, Any], state: dict, scratch: str) -> list[dict[str, Any]]:
    """Per save mode, without and with `AsyncMode(max_staging_bytes=cap)`: the peak resident
    bytes of a save over the rank's (and its running writer's) before it, from fresh staging
    buffers, and the save's own staging high-water mark (`SaveResult.staging_peak_bytes`)."""
    import torch

    import ckptlib
    from ckptlib.saving import background_save

    out = []
    cap = cfg["cap_mib"] << 20
    for mode in SAVE_MODES:
        for capped in (None, cap):
            background_save.release_staging()
            warm = os.path.join(scratch, f"mem-warm-{mode}")
            ckptlib.async_save(warm, {"x": torch.zeros(1)}, async_mode=mode).wait()  # the writer runs
            barrier()
            before = resident_bytes()
            with Meter() as meter:
                target = os.path.join(scratch, f"mem-{mode}-{capped}")
                result = ckptlib.async_save(target, state, async_mode=mode, max_staging_bytes=capped).wait()
            out.append(
                {"mode": mode, "cap": capped, "over": meter.peak - before, "staging_peak": result.staging_peak_bytes}
            )
            barrier()
            if rank_world()[0] == 0:
                shutil.rmtree(target, ignore_errors=True)
                shutil.rmtree(warm, ignore_errors=True)
    return out


def rank_async(cfg: dict[str, Any], scratch: str) -> dict[str, Any]:
    """Every phase on this rank; its raw measurements."""
    import torch

    from ckptlib.saving import background_save

    torch.set_num_threads(1)
    state = make_state(cfg["mib"], cfg["tensors"])
    out: dict[str, Any] = {"shard_bytes": shard_bytes(state)}
    try:
        out["first"] = _first_saves(cfg, state, scratch)
        out["memory"] = _staging_memory(cfg, state, scratch)
        out["reps"] = _steps(cfg, state, scratch)
        out["ok"] = _same_after_load(cfg, state, scratch)
    finally:
        background_save.release_staging()
    barrier()
    return out


def ratio(runs: dict[str, Any], mode: str) -> float:
    """A save mode's median step over the no-save median of the same repetition and loop."""
    return statistics.median(runs[mode]["steps"]) / statistics.median(runs["none"]["steps"])
