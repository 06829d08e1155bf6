"""In-rank bodies of `ckpt bench`'s local-disk measurements: saves and loads of every method,
interleaved in a rotating order (`rank_io`), and the peak RSS of a fresh rank that does one save
or one load (`rank_rss`)."""

from __future__ import annotations

import os
import resource
import time
from typing import Any

from ckptlib.bench.rank_ops import (
    barrier,
    evict,
    local_bytes,
    make_state,
    rank_world,
    raw_read,
    raw_write,
    remove_tree,
    same_values,
    settle,
    timed_use,
    warm,
)


def _stage_copy(state: dict[str, Any], buffers: list) -> None:
    """The staging ceiling: this rank's shards copied into preallocated buffers (`copy_`),
    what an async save's staging does at best."""
    for t, buf in zip(state["params"].values(), buffers):
        buf.copy_(t.to_local())


def rank_io(root: str, size_mib: int, reps: int, cold: bool, keep: str, do_async: bool) -> dict[str, Any]:
    """Saves and loads of one (size, world size), all methods interleaved; one untimed
    warm-up round first (round -1: first-call costs, the staging buffers of async saves)."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptlib
    from ckptlib.bench import crc_meter

    rank, world = rank_world()
    state = make_state(size_mib)
    template = make_state(size_mib, fill=False)
    times: dict[str, list[float]] = {}
    uses: dict[str, list[dict[str, float]]] = {}
    crc: list[dict[str, float]] = []
    blocking: dict[str, list[float]] = {}
    ok = True
    staging = [torch.empty_like(t.to_local()) for t in state["params"].values()] if do_async else []

    def rec(rep: int, name: str, use: dict[str, float]) -> None:
        if rep >= 0:
            times.setdefault(name, []).append(use["wall_s"])
            uses.setdefault(name, []).append(use)

    saves = ["ckptlib", "dcp", "raw"] + (["torch"] if world == 1 else [])
    saves += ["async", "async_bg", "memcpy"] if do_async else []
    for rep in range(-1, reps):
        base = f"{root}/rep{rep + 1}"
        order = saves[rep % len(saves) :] + saves[: rep % len(saves)]
        for method in order:
            path = f"{base}/{method}"
            settle()
            if method == "ckptlib":
                with crc_meter.metering() as meter:
                    rec(rep, "save_ckptlib", timed_use(lambda: ckptlib.save(path, state)))
                if rep >= 0:
                    crc.append(meter.as_dict())
            elif method == "dcp":
                rec(rep, "save_dcp", timed_use(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path))))
            elif method == "raw":
                rec(rep, "save_raw", timed_use(lambda: raw_write(path, state)))
            elif method == "torch":
                plain = {k: t.to_local() for k, t in state["params"].items()}

                def tsave():
                    os.makedirs(path, exist_ok=True)
                    with open(f"{path}/full.pt", "wb") as f:
                        torch.save(plain, f)
                        f.flush()
                        os.fsync(f.fileno())

                rec(rep, "save_torch", timed_use(tsave))
            elif method == "memcpy":
                rec(rep, "stage_memcpy", timed_use(lambda: _stage_copy(state, staging)))
            elif method == "async":
                handle = []
                barrier()
                t0 = time.perf_counter()
                handle.append(ckptlib.async_save(path, state))
                blocked = time.perf_counter() - t0
                handle[0].wait()
                barrier()
                if rep >= 0:
                    times.setdefault("save_async_total", []).append(time.perf_counter() - t0)
                blocking.setdefault("first" if rep < 0 else "steady", []).append(blocked)
            elif method == "async_bg":
                barrier()
                t0 = time.perf_counter()
                handle = ckptlib.async_save(path, state, background_staging=True)
                blocked = time.perf_counter() - t0
                handle.wait_staged()
                staged = time.perf_counter() - t0
                handle.wait()
                barrier()
                if rep >= 0:  # steady state: staging buffers exist (shared with "async")
                    blocking.setdefault("bg_steady", []).append(blocked)
                    blocking.setdefault("bg_staged", []).append(staged)

        loads = ["ckptlib_verify", "ckptlib_noverify", "dcp", "raw"] + (["torch"] if world == 1 else [])
        modes = ["warm"] + (["cold"] if cold else [])
        for mode in modes:
            order = loads[rep % len(loads) :] + loads[: rep % len(loads)]
            for method in order:
                src = {"ckptlib_verify": "ckptlib", "ckptlib_noverify": "ckptlib"}.get(method, method)
                path = f"{base}/{src}"
                if mode == "warm":
                    warm(path)
                else:
                    evict(path)
                if method.startswith("ckptlib"):
                    verify = method == "ckptlib_verify"
                    use = timed_use(lambda: ckptlib.load(path, template, verify=verify))
                    ok = ok and same_values(state, template)
                elif method == "dcp":
                    use = timed_use(lambda: dcp.load(template, storage_reader=dcp.FileSystemReader(path)))
                    ok = ok and same_values(state, template)
                elif method == "raw":
                    use = timed_use(lambda: raw_read(path, template))
                    ok = ok and same_values(state, template)
                else:
                    use = timed_use(lambda: torch.load(f"{path}/full.pt", weights_only=True))
                rec(rep, f"load_{method}_{mode}", use)
                for t in template["params"].values():
                    t.to_local().zero_()
        if rep == reps - 1:  # kept for the resharding phase
            barrier()
            if rank == 0:
                os.rename(f"{base}/ckptlib", keep)
        remove_tree(base)
    return {
        "rank": rank,
        "world": world,
        "shard_bytes": local_bytes(state),
        "times": times,
        "usage": uses,
        "crc": crc,
        "async_blocking": blocking,
        "ok": ok,
    }


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rank_rss(op: str, path: str, size_mib: int) -> dict[str, Any]:
    """Peak RSS of a fresh rank that holds its shard and does one save or one load."""
    import torch.distributed.checkpoint as dcp

    import ckptlib

    rank, world = rank_world()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss0 = _vm_rss()
    state = make_state(size_mib, fill=not op.startswith("load"))
    ready = _vm_rss()  # the process plus its state: the peak above this is what the op needs
    if op.startswith("load"):
        barrier()
        if op == "load_ckptlib":
            ckptlib.load(path, state)
        else:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    else:
        barrier()
        if op == "save_ckptlib":
            ckptlib.save(path, state)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    barrier()
    return {
        "rank": rank,
        "world": world,
        "op": op,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_maxrss": baseline,
        "rss_at_start": rss0,
        "rss_with_state": ready,
        "shard_bytes": local_bytes(state),
    }
