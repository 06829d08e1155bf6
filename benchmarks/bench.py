"""ckptlib against raw DCP, torch.save, the disk and the cloud SDKs, side by side in one run.

    python benchmarks/bench.py [--quick] [--json OUT] [--plot OUT.png] [--sizes 64 256 1024]

What is measured (every number is the median over repetitions; ckptlib and its baselines
alternate inside each repetition, in a rotating order, so machine noise hits all of them):

- save: ckptlib.save, dcp.save (FileSystemWriter, its defaults: one file per rank, fsync)
  and a raw parallel write of the same bytes (one file per rank, write + fsync: the disk's
  limit), at each world size, for a DTensor state sharded (Shard(0)) over the ranks;
  torch.save of the full state on one rank (world size 1 rows).
- load: ckptlib.load with verify=True and verify=False (the difference is the checksum
  cost), dcp.load (FileSystemReader), torch.load (world size 1). Warm: every file of the
  checkpoint is read once before the timed load, so all loads come from the page cache.
  Cold (when /proc/sys/vm/drop_caches is writable and not --quick): the page cache is
  dropped before the timed load.
- resharded load: the checkpoint saved at N ranks loaded at M, against the one saved at M.
- peak RSS per rank: ru_maxrss of fresh rank processes that only load (or only save), next
  to the rank's shard size; the ranks are forked from a forkserver that imported torch, so
  the baseline (~the forkserver's RSS) is reported too.
- async save: how long `ckptlib.async_save(...)` blocks (first save of a process:
  staging buffers are allocated; later saves reuse them) against a synchronous save; and
  with `background_staging=True`, how long it blocks and when `wait_staged()` returns.
- cloud storage (benchmarks/cloud.py; S3 on moto, GCS on fake-gcs-server, Azure on Azurite,
  all on 127.0.0.1): ckptlib save/load against each SDK's own plain upload/download of the
  same bytes per rank.

Throughput is state bytes / wall time of the slowest rank (barriers around every timed op;
every timed save starts after an untimed `os.sync()`, so it waits for its own writeback only).
`main(argv)` is the entry point (`ckpt bench` may call it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

MiB = 1 << 20
N_TENSORS = 16
COLS = 1024

TARGETS = {
    "cloud_save": 0.9,  # ckptlib save throughput >= 0.9x the cloud SDK's plain upload of the same bytes
    "save_vs_dcp": 0.9,  # ckptlib save throughput >= 0.9x raw DCP at the same world size
    "save_vs_raw": 0.7,  # ... and >= 0.7x the raw parallel write
    "reshard": 1.15,  # resharded load time <= 1.15x same-N load time
    "checksum": 0.10,  # (verify - no verify) / verify load time <= 10%
    "rss_factor": 1.5,  # load peak RSS per rank <= 1.5x shard + 300 MiB
    "rss_slack_mib": 300,
    "async_block": 0.10,  # blocking part of an async save <= 10% of a sync save (>= 256 MiB)
}


# --------------------------------------------------------------------------- in the ranks


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _make_state(size_mib: int, fill: bool = True) -> dict[str, Any]:
    """{"params": {t0..t15: DTensor}} of `size_mib` MiB of float32 in all, Shard(0) over the ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = _rank()
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, (size_mib * MiB) // (N_TENSORS * COLS * 4))
    rows -= rows % world
    params = {}
    for i in range(N_TENSORS):
        local = torch.empty(rows // world, COLS)
        if fill:
            gen = torch.Generator().manual_seed(1000 * i + rank)
            local.uniform_(generator=gen)
        else:
            local.zero_()
        params[f"t{i}"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, COLS), stride=(COLS, 1)
        )
    return {"params": params}


def _local_bytes(state: dict[str, Any]) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in state["params"].values())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_write(path: str, state: dict[str, Any]) -> None:
    """The disk's limit: this rank's bytes into one file, write + fsync."""
    rank, _ = _rank()
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, f"{rank}.bin")
    with open(name, "wb") as f:
        for t in state["params"].values():
            f.write(memoryview(t.to_local().numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path)


def _warm(path: str) -> None:
    """Read every file below `path` once (rank 0), so the timed load is from the page cache."""
    rank, _ = _rank()
    if rank == 0:
        buf = bytearray(8 * MiB)
        for dirpath, _, files in os.walk(path):
            for name in files:
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def _drop_caches() -> None:
    rank, _ = _rank()
    if rank == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def _timed(fn) -> float:
    _barrier()
    t0 = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - t0


def _settle() -> None:
    """Untimed: write back every dirty page first, so a timed save's fsync waits for its own
    bytes and not for the previous method's (without this, identical saves here took 0.7 s or
    2.8 s depending on what ran before them)."""
    rank, _ = _rank()
    _barrier()
    if rank == 0:
        os.sync()
    _barrier()


def _rm(path: str) -> None:
    rank, _ = _rank()
    _barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    _barrier()


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(torch.equal(a["params"][k].to_local(), b["params"][k].to_local()) for k in a["params"])


def rank_io(root: str, size_mib: int, reps: int, cold: bool, keep: str, do_async: bool) -> dict[str, Any]:
    """Saves and loads of one (size, world size), all methods interleaved."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptlib

    rank, world = _rank()
    state = _make_state(size_mib)
    template = _make_state(size_mib, fill=False)
    times: dict[str, list[float]] = {}
    blocking: dict[str, list[float]] = {}
    ok = True

    def rec(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    saves = ["ckptlib", "dcp", "raw"] + (["torch"] if world == 1 else []) + (["async", "async_bg"] if do_async else [])
    for rep in range(reps):
        base = f"{root}/rep{rep}"
        order = saves[rep % len(saves) :] + saves[: rep % len(saves)]
        for method in order:
            path = f"{base}/{method}"
            _settle()
            if method == "ckptlib":
                rec("save_ckptlib", _timed(lambda: ckptlib.save(path, state)))
            elif method == "dcp":
                rec("save_dcp", _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path))))
            elif method == "raw":
                rec("save_raw", _timed(lambda: _raw_write(path, state)))
            elif method == "torch":
                plain = {k: t.to_local() for k, t in state["params"].items()}

                def tsave():
                    os.makedirs(path, exist_ok=True)
                    with open(f"{path}/full.pt", "wb") as f:
                        torch.save(plain, f)
                        f.flush()
                        os.fsync(f.fileno())

                rec("save_torch", _timed(tsave))
            elif method == "async":
                handle = []
                _barrier()
                t0 = time.perf_counter()
                handle.append(ckptlib.async_save(path, state))
                blocked = time.perf_counter() - t0
                handle[0].wait()
                _barrier()
                rec("save_async_total", time.perf_counter() - t0)
                blocking.setdefault("first" if rep == 0 else "steady", []).append(blocked)
            elif method == "async_bg":
                _barrier()
                t0 = time.perf_counter()
                handle = ckptlib.async_save(path, state, background_staging=True)
                blocked = time.perf_counter() - t0
                handle.wait_staged()
                staged = time.perf_counter() - t0
                handle.wait()
                _barrier()
                if rep > 0:  # steady state: staging buffers exist (shared with "async")
                    blocking.setdefault("bg_steady", []).append(blocked)
                    blocking.setdefault("bg_staged", []).append(staged)

        loads = ["ckptlib_verify", "ckptlib_noverify", "dcp"] + (["torch"] if world == 1 else [])
        modes = ["warm"] + (["cold"] if cold else [])
        for mode in modes:
            order = loads[rep % len(loads) :] + loads[: rep % len(loads)]
            for method in order:
                src = {"ckptlib_verify": "ckptlib", "ckptlib_noverify": "ckptlib", "dcp": "dcp", "torch": "torch"}[
                    method
                ]
                path = f"{base}/{src}"
                if mode == "warm":
                    _warm(path)
                else:
                    _drop_caches()
                if method.startswith("ckptlib"):
                    verify = method == "ckptlib_verify"
                    seconds = _timed(lambda: ckptlib.load(path, template, verify=verify))
                    ok = ok and _same(state, template)
                elif method == "dcp":
                    seconds = _timed(lambda: dcp.load(template, storage_reader=dcp.FileSystemReader(path)))
                    ok = ok and _same(state, template)
                else:
                    seconds = _timed(lambda: torch.load(f"{path}/full.pt", weights_only=True))
                rec(f"load_{method}_{mode}", seconds)
                for t in template["params"].values():
                    t.to_local().zero_()
        if rep == reps - 1:  # kept for the resharding phase
            _barrier()
            if rank == 0:
                os.rename(f"{base}/ckptlib", keep)
        _rm(base)
    return {
        "rank": rank,
        "world": world,
        "shard_bytes": _local_bytes(state),
        "times": times,
        "async_blocking": blocking,
        "ok": ok,
    }


def rank_reshard(sources: dict[int, str], size_mib: int, reps: int, verify_modes: list[bool]) -> dict[str, Any]:
    """Loads of checkpoints saved at every N into this world size M, interleaved."""
    import ckptlib

    rank, world = _rank()
    template = _make_state(size_mib, fill=False)
    times: dict[str, list[float]] = {}
    keys = sorted(sources)
    for rep in range(reps):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        for n in order:
            for verify in verify_modes:
                _warm(sources[n])
                seconds = _timed(lambda: ckptlib.load(sources[n], template, verify=verify))
                times.setdefault(f"{n}:{int(verify)}", []).append(seconds)
    return {"rank": rank, "world": world, "times": times}


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

    rank, world = _rank()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss0 = _vm_rss()
    state = _make_state(size_mib, fill=not op.startswith("load"))
    ready = _vm_rss()  # the process plus its state: the peak above this is what the op needs
    if op.startswith("load"):
        _barrier()
        if op == "load_ckptlib":
            ckptlib.load(path, state)
        else:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    else:
        _barrier()
        if op == "save_ckptlib":
            ckptlib.save(path, state)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    _barrier()
    return {
        "rank": rank,
        "world": world,
        "op": op,
        "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_maxrss": baseline,
        "rss_at_start": rss0,
        "rss_with_state": ready,
        "shard_bytes": _local_bytes(state),
    }


# --------------------------------------------------------------------------- the driver


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _max_over_ranks(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    """Per repetition, the slowest rank (they are equal up to the barrier's skew)."""
    columns = [r["times"].get(key, []) for r in per_rank]
    return [max(vals) for vals in zip(*columns)] if all(columns) else []


def _can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ckptlib.testing import launch

    cold = (not args.quick) and (not args.warm_only) and _can_drop_caches()
    root = tempfile.mkdtemp(prefix="ckptlib-bench-", dir=args.dir)
    results: dict[str, Any] = {
        "command": "python benchmarks/bench.py " + " ".join(args.argv),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "sizes_mib": args.sizes,
        "world_sizes": args.world_sizes,
        "reps": args.reps,
        "cold_loads": cold,
        "io": [],
        "reshard": [],
        "rss": [],
        "cloud": [],
        "notes": [],
    }
    if not cold:
        results["notes"].append(
            "loads are from the page cache only" + ("" if _can_drop_caches() else " (cannot drop caches here)")
        )
    try:
        import torch

        results["machine"]["torch"] = torch.__version__
        from ckptlib.format import checksum

        results["machine"]["crc32"] = getattr(checksum.crc32, "__module__", "zlib") or "zlib"
        for size in args.sizes:
            kept: dict[int, str] = {}
            for ws in args.world_sizes:
                keep = f"{root}/keep-{size}-w{ws}"
                _log(f"io: {size} MiB at {ws} ranks")
                out = launch(
                    ws,
                    rank_io,
                    f"{root}/io-{size}-w{ws}",
                    size,
                    args.reps,
                    cold,
                    keep,
                    not args.no_async,
                    timeout=args.timeout,
                )
                kept[ws] = keep
                entry = {
                    "size_mib": size,
                    "world": ws,
                    "shard_bytes": out[0]["shard_bytes"],
                    "ok": all(r["ok"] for r in out),
                    "times": {},
                }
                for key in out[0]["times"]:
                    entry["times"][key] = _max_over_ranks(out, key)
                entry["async_blocking"] = {
                    k: [max(r["async_blocking"][k][i] for r in out) for i in range(len(out[0]["async_blocking"][k]))]
                    for k in out[0]["async_blocking"]
                }
                results["io"].append(entry)
            if not args.no_reshard and len(args.world_sizes) > 1:
                for m in args.world_sizes:
                    _log(f"reshard: {size} MiB into {m} ranks")
                    modes = [True] if args.quick else [True, False]
                    out = launch(m, rank_reshard, kept, size, args.reps, modes, timeout=args.timeout)
                    for n in args.world_sizes:
                        for verify in modes:
                            results["reshard"].append(
                                {
                                    "size_mib": size,
                                    "saved": n,
                                    "loaded": m,
                                    "verify": verify,
                                    "times": _max_over_ranks(out, f"{n}:{int(verify)}"),
                                }
                            )
            if not args.no_rss:
                for ws in args.world_sizes:
                    _log(f"rss: {size} MiB at {ws} ranks")
                    dcp_path = f"{root}/rss-dcp-{size}-w{ws}"
                    ck_path = f"{root}/rss-ck-{size}-w{ws}"
                    row: dict[str, Any] = {"size_mib": size, "world": ws}
                    for op, path in (
                        ("save_ckptlib", ck_path),
                        ("save_dcp", dcp_path),
                        ("load_ckptlib", ck_path),
                        ("load_dcp", dcp_path),
                    ):
                        out = launch(ws, rank_rss, op, path, size, timeout=args.timeout)
                        row[op] = max(r["peak"] for r in out)
                        row[f"{op}_baseline"] = max(r["rss_at_start"] for r in out)
                        row[f"{op}_extra"] = max(r["peak"] - r["rss_with_state"] for r in out)
                        row["shard_bytes"] = max(r["shard_bytes"] for r in out)
                    results["rss"].append(row)
                    shutil.rmtree(dcp_path, ignore_errors=True)
                    shutil.rmtree(ck_path, ignore_errors=True)
            for path in kept.values():
                shutil.rmtree(path, ignore_errors=True)
        if args.clouds:
            from benchmarks.cloud import run_cloud

            results["cloud"] = run_cloud(args, launch, _log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


# --------------------------------------------------------------------------- report


def _cloud_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The cloud rows of a run (older JSON files call them "s3")."""
    return results.get("cloud") or results.get("s3") or []


def _best(values: list[float]) -> float:
    return min(values) if values else float("nan")


_ESTIMATORS = {"median": lambda values: _median(values), "best": _best}


def _tp(size_mib: int, seconds: float) -> float:
    return size_mib / seconds if seconds and seconds == seconds else float("nan")


def summarize(results: dict[str, Any], estimator: str = "median") -> dict[str, Any]:
    """Throughputs, ratios and target verdicts from the raw timings, each timing aggregated
    over the repetitions by `estimator`: "median", or "best" (the fastest repetition: on a
    shared machine, noise only ever adds time, so the best run is the least disturbed)."""
    _median = _ESTIMATORS[estimator]
    summary: dict[str, Any] = {
        "save": [],
        "load": [],
        "reshard": [],
        "rss": [],
        "async": [],
        "cloud": [],
        "targets": {},
    }
    verdict: dict[str, list] = {
        k: []
        for k in (
            "save_vs_dcp",
            "save_vs_raw",
            "reshard",
            "reshard_noverify",
            "checksum",
            "checksum_cold",
            "rss",
            "async_block",
            "async_block_bg",
            "cloud_save",
        )
    }
    for e in results["io"]:
        t = {k: _median(v) for k, v in e["times"].items()}
        size, ws = e["size_mib"], e["world"]
        row = {
            "size_mib": size,
            "world": ws,
            "ok": e["ok"],
            "ckptlib": _tp(size, t.get("save_ckptlib")),
            "dcp": _tp(size, t.get("save_dcp")),
            "raw": _tp(size, t.get("save_raw")),
            "torch": _tp(size, t.get("save_torch", float("nan"))),
        }
        row["vs_dcp"] = row["ckptlib"] / row["dcp"]
        row["vs_raw"] = row["ckptlib"] / row["raw"]
        summary["save"].append(row)
        verdict["save_vs_dcp"].append((row["vs_dcp"], f"{size} MiB, {ws} ranks"))
        verdict["save_vs_raw"].append((row["vs_raw"], f"{size} MiB, {ws} ranks"))
        lrow = {"size_mib": size, "world": ws}
        for key in (
            "ckptlib_verify_warm",
            "ckptlib_noverify_warm",
            "dcp_warm",
            "torch_warm",
            "ckptlib_verify_cold",
            "ckptlib_noverify_cold",
            "dcp_cold",
            "torch_cold",
        ):
            lrow[key] = _tp(size, t.get(f"load_{key}", float("nan")))
        v, nv = t.get("load_ckptlib_verify_warm"), t.get("load_ckptlib_noverify_warm")
        lrow["checksum_share"] = (v - nv) / v if v and nv else float("nan")
        v, nv = t.get("load_ckptlib_verify_cold"), t.get("load_ckptlib_noverify_cold")
        lrow["checksum_share_cold"] = (v - nv) / v if v and nv else float("nan")
        if lrow["checksum_share_cold"] == lrow["checksum_share_cold"]:
            verdict["checksum_cold"].append((lrow["checksum_share_cold"], f"{size} MiB, {ws} ranks"))
        summary["load"].append(lrow)
        verdict["checksum"].append((lrow["checksum_share"], f"{size} MiB, {ws} ranks"))
        if "save_async_total" in t:
            sync = t["save_ckptlib"]
            first = _median(e["async_blocking"].get("first", []))
            steady = _median(e["async_blocking"].get("steady", []))
            bg_block = _median(e["async_blocking"].get("bg_steady", []))
            bg_staged = _median(e["async_blocking"].get("bg_staged", []))
            arow = {
                "size_mib": size,
                "world": ws,
                "sync_s": sync,
                "first_block_s": first,
                "steady_block_s": steady,
                "total_s": t["save_async_total"],
                "first_ratio": first / sync,
                "steady_ratio": steady / sync if steady == steady else float("nan"),
                "bg_block_s": bg_block,
                "bg_staged_s": bg_staged,
                "bg_ratio": bg_block / sync,
            }
            summary["async"].append(arow)
            if size >= 256:
                use = arow["steady_ratio"] if arow["steady_ratio"] == arow["steady_ratio"] else arow["first_ratio"]
                verdict["async_block"].append((use, f"{size} MiB, {ws} ranks (steady state)"))
                if bg_block == bg_block:
                    verdict["async_block_bg"].append((arow["bg_ratio"], f"{size} MiB, {ws} ranks"))
    same = {
        (r["size_mib"], r["loaded"], r["verify"]): _median(r["times"])
        for r in results["reshard"]
        if r["saved"] == r["loaded"]
    }
    for r in results["reshard"]:
        if r["saved"] == r["loaded"]:
            continue
        base = same.get((r["size_mib"], r["loaded"], r["verify"]))
        secs = _median(r["times"])
        ratio = secs / base if base else float("nan")
        summary["reshard"].append(
            {
                **{k: r[k] for k in ("size_mib", "saved", "loaded", "verify")},
                "seconds": secs,
                "same_n_seconds": base,
                "ratio": ratio,
            }
        )
        if r["size_mib"] >= 256 or len({x["size_mib"] for x in results["reshard"]}) == 1:
            verdict["reshard" if r["verify"] else "reshard_noverify"].append(
                (ratio, f"{r['size_mib']} MiB {r['saved']}->{r['loaded']}")
            )
    for r in results["rss"]:
        shard = r["shard_bytes"] / MiB
        limit = TARGETS["rss_factor"] * shard + TARGETS["rss_slack_mib"]
        row = {"size_mib": r["size_mib"], "world": r["world"], "shard_mib": shard, "limit_mib": limit}
        for op in ("load_ckptlib", "load_dcp", "save_ckptlib", "save_dcp"):
            row[f"{op}_mib"] = r[op] / MiB
            row[f"{op}_over_base"] = (r[op] - r[f"{op}_baseline"]) / MiB
            row[f"{op}_extra"] = r.get(f"{op}_extra", float("nan")) / MiB
        summary["rss"].append(row)
        verdict["rss"].append((row["load_ckptlib_mib"] / limit, f"{r['size_mib']} MiB, {r['world']} ranks"))
    from benchmarks.cloud import summarize_cloud

    summary["cloud"] = summarize_cloud(_cloud_rows(results), _median)
    for r in summary["cloud"]:
        if "skipped" not in r:
            verdict["cloud_save"].append((r["save_ratio"], f"{r['backend']} {r['size_mib']} MiB, {r['world']} ranks"))
    limits = {
        "save_vs_dcp": (">=", TARGETS["save_vs_dcp"]),
        "save_vs_raw": (">=", TARGETS["save_vs_raw"]),
        "reshard": ("<=", TARGETS["reshard"]),
        "reshard_noverify": ("<=", TARGETS["reshard"]),
        "checksum": ("<=", TARGETS["checksum"]),
        "checksum_cold": ("<=", TARGETS["checksum"]),
        "rss": ("<=", 1.0),
        "async_block": ("<=", TARGETS["async_block"]),
        "async_block_bg": ("<=", TARGETS["async_block"]),
        "cloud_save": (">=", TARGETS["cloud_save"]),
    }
    for name, values in verdict.items():
        values = [(v, where) for v, where in values if v == v]
        if not values:
            summary["targets"][name] = {"status": "not measured"}
            continue
        op, limit = limits[name]
        worst = min(values) if op == ">=" else max(values)
        met = all((v >= limit) if op == ">=" else (v <= limit) for v, _ in values)
        misses = [where for v, where in values if not ((v >= limit) if op == ">=" else (v <= limit))]
        summary["targets"][name] = {
            "status": "met" if met else "missed",
            "worst": worst[0],
            "where": worst[1],
            "limit": f"{op} {limit}",
            "misses": misses,
        }
    return summary


def _f(x: float, digits: int = 0) -> str:
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def markdown(results: dict[str, Any], summary: dict[str, Any], estimator: str = "median") -> str:
    out = []
    out.append(f"Command: `{results['command']}`  ")
    m = results["machine"]
    how = "medians" if estimator == "median" else "best (fastest) repetition of each"
    out.append(
        f"Machine: {m['cpus']} CPUs, Python {m['python']}, torch {m.get('torch')}, CRC-32 via `{m.get('crc32')}`; "
        f"{results['reps']} repetitions, {how}; "
        f"loads {'warm and cold' if results['cold_loads'] else 'from the page cache'}."
    )
    out.append("")
    out.append("### Save throughput (MiB/s; ratios are ckptlib / baseline)")
    out.append("| state MiB | ranks | ckptlib | raw DCP | raw write+fsync | torch.save | ckptlib/DCP | ckptlib/raw |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in summary["save"]:
        out.append(
            f"| {r['size_mib']} | {r['world']} | {_f(r['ckptlib'])} | {_f(r['dcp'])} | {_f(r['raw'])} | "
            f"{_f(r['torch'])} | {_f(r['vs_dcp'], 2)} | {_f(r['vs_raw'], 2)} |"
        )
    out.append("")
    out.append("### Load throughput (MiB/s)")
    cold = results["cold_loads"]
    head = "| state MiB | ranks | ckptlib verify | ckptlib no verify | raw DCP | torch.load | checksum share |"
    sep = "|---:|---:|---:|---:|---:|---:|---:|"
    if cold:
        head += " cold: ckptlib verify | cold: no verify | cold: DCP | cold: torch.load | cold checksum share |"
        sep += "---:|---:|---:|---:|---:|"
    out.append(head)
    out.append(sep)
    for r in summary["load"]:
        line = (
            f"| {r['size_mib']} | {r['world']} | {_f(r['ckptlib_verify_warm'])} | {_f(r['ckptlib_noverify_warm'])} | "
            f"{_f(r['dcp_warm'])} | {_f(r['torch_warm'])} | {_f(100 * r['checksum_share'], 1)}% |"
        )
        if cold:
            line += (
                f" {_f(r['ckptlib_verify_cold'])} | {_f(r['ckptlib_noverify_cold'])} | {_f(r['dcp_cold'])} | "
                f"{_f(r['torch_cold'])} | {_f(100 * r['checksum_share_cold'], 1)}% |"
            )
        out.append(line)
    if summary["reshard"]:
        out.append("")
        out.append("### Resharded load (warm): saved at N, loaded at M, against the same state saved at M")
        out.append("| state MiB | N → M | verify | seconds | same-N seconds | ratio |")
        out.append("|---:|---|---|---:|---:|---:|")
        for r in summary["reshard"]:
            out.append(
                f"| {r['size_mib']} | {r['saved']} → {r['loaded']} | {r['verify']} | {_f(r['seconds'], 3)} | "
                f"{_f(r['same_n_seconds'], 3)} | {_f(r['ratio'], 2)} |"
            )
    if summary["rss"]:
        out.append("")
        out.append("### Peak RSS per rank (MiB; fresh rank processes forked from a forkserver that imported torch)")
        out.append(
            "In brackets: the peak above the rank's RSS once its state (or load template) existed, i.e. "
            "what the save or load itself needed."
        )
        out.append("")
        out.append(
            "| state MiB | ranks | shard | load ckptlib | load DCP | limit 1.5×shard+300 | save ckptlib | save DCP |"
        )
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in summary["rss"]:
            out.append(
                f"| {r['size_mib']} | {r['world']} | {_f(r['shard_mib'])} | {_f(r['load_ckptlib_mib'])} "
                f"(+{_f(r['load_ckptlib_extra'])}) | {_f(r['load_dcp_mib'])} (+{_f(r['load_dcp_extra'])}) | "
                f"{_f(r['limit_mib'])} | {_f(r['save_ckptlib_mib'])} (+{_f(r['save_ckptlib_extra'])}) | "
                f"{_f(r['save_dcp_mib'])} (+{_f(r['save_dcp_extra'])}) |"
            )
    if summary["async"]:
        out.append("")
        out.append("### Async save: time `async_save(...)` blocks the caller")
        out.append(
            "| state MiB | ranks | sync save s | first async: blocked s | later async: blocked s | async total s "
            "| first/sync | later/sync | background staging: blocked s | staged after s | blocked/sync |"
        )
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in summary["async"]:
            out.append(
                f"| {r['size_mib']} | {r['world']} | {_f(r['sync_s'], 3)} | {_f(r['first_block_s'], 3)} | "
                f"{_f(r['steady_block_s'], 3)} | {_f(r['total_s'], 3)} | {_f(r['first_ratio'], 3)} | "
                f"{_f(r['steady_ratio'], 3)} | {_f(r['bg_block_s'], 3)} | {_f(r['bg_staged_s'], 3)} | "
                f"{_f(r['bg_ratio'], 3)} |"
            )
    from benchmarks.cloud import markdown_cloud

    out.extend(markdown_cloud(summary.get("cloud", []), _f))
    out.append("")
    out.append("### Targets")
    out.append("| target | limit | worst | where | status |")
    out.append("|---|---|---:|---|---|")
    names = {
        "save_vs_dcp": "save vs raw DCP",
        "save_vs_raw": "save vs raw parallel write",
        "reshard": "resharded / same-N load (verify=True)",
        "reshard_noverify": "resharded / same-N load (verify=False)",
        "checksum": "checksum share of load (page cache)",
        "checksum_cold": "checksum share of load (cold cache)",
        "rss": "load peak RSS / (1.5×shard+300 MiB)",
        "async_block": "async blocking / sync save (≥256 MiB)",
        "async_block_bg": "async blocking, background staging / sync save (≥256 MiB)",
        "cloud_save": "cloud save / the SDK's plain upload",
    }
    for key, label in names.items():
        t = summary["targets"].get(key, {"status": "not measured"})
        if t["status"] == "not measured":
            out.append(f"| {label} | | | | not measured |")
        else:
            others = [w for w in t.get("misses", []) if w != t["where"]]
            extra = f" (also: {'; '.join(others)})" if t["status"] == "missed" and others else ""
            out.append(f"| {label} | {t['limit']} | {_f(t['worst'], 2)} | {t['where']} | {t['status']}{extra} |")
    bad = [e for e in results["io"] if not e["ok"]] + [r for r in _cloud_rows(results) if not r.get("ok", True)]
    if bad:
        out.append("")
        out.append(f"**Round-trip check failed** in {len(bad)} configuration(s): loaded values differ from saved ones.")
    for note in results["notes"]:
        out.append(f"\nNote: {note}.")
    return "\n".join(out)


def _panel(ax, ws: list[int], rows: list[dict[str, Any]], title: str, series, one_rank: tuple[str, str]) -> None:
    """One plot panel: MiB/s against world size for each (key, label, style) in `series`,
    plus the single-rank baseline `one_rank` (key, label) as a cross where it was measured."""
    for key, label, style in series:
        ax.plot(ws, [r[key] for r in rows], style, label=label)
    single = [r[one_rank[0]] for r in rows if r["world"] == 1]
    if single and single[0] == single[0]:
        ax.plot([1], single, "kx", label=one_rank[1])
    ax.set_title(title)
    ax.set_xlabel("world size")
    ax.set_ylabel("MiB/s")
    ax.set_xticks(ws)
    ax.legend(fontsize=7)


def plot(results: dict[str, Any], summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size_mib"] for r in summary["save"]})
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.5 * len(sizes), 7), squeeze=False)
    for col, size in enumerate(sizes):
        rows = [r for r in summary["save"] if r["size_mib"] == size]
        ws = [r["world"] for r in rows]
        _panel(
            axes[0][col],
            ws,
            rows,
            f"save, {size} MiB",
            (("ckptlib", "ckptlib", "o-"), ("dcp", "raw DCP", "s--"), ("raw", "raw write+fsync", "^:")),
            ("torch", "torch.save (1 rank)"),
        )
        lrows = [r for r in summary["load"] if r["size_mib"] == size]
        _panel(
            axes[1][col],
            ws,
            lrows,
            f"load (page cache), {size} MiB",
            (
                ("ckptlib_verify_warm", "ckptlib (verify)", "o-"),
                ("ckptlib_noverify_warm", "ckptlib (no verify)", "o:"),
                ("dcp_warm", "raw DCP", "s--"),
            ),
            ("torch_warm", "torch.load (1 rank)"),
        )
    fig.suptitle("ckptlib vs baselines (2-core box: compare within a panel, not across runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(text: str, markdown_path: str | None, stream=None) -> None:
    print(text, file=stream or sys.stdout)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB only, 2 repetitions, no cold loads (< 2 minutes)")
    parser.add_argument("--sizes", type=int, nargs="+", help="state sizes in MiB (default 64 256 1024)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, help="repetitions (default 3; --quick: 2)")
    parser.add_argument(
        "--cloud-sizes", type=int, nargs="+", help="MiB per state for the cloud backends (default 32 128; --quick: 32)"
    )
    parser.add_argument(
        "--clouds",
        nargs="*",
        choices=("s3", "gcs", "azure"),
        default=["s3", "gcs", "azure"],
        help="cloud backends to compare with their SDKs (default: all three; none: skip)",
    )
    parser.add_argument(
        "--json",
        metavar="OUT",
        nargs="?",
        const="-",
        help="write raw timings and the summary as JSON to OUT, or to stdout without OUT or with '-' "
        "(the tables then go to stderr)",
    )
    parser.add_argument("--plot", metavar="OUT.png", help="write a PNG plot (needs matplotlib)")
    parser.add_argument("--markdown", metavar="OUT.md", help="also write the tables to this file")
    parser.add_argument("--dir", help="scratch directory (default: the system temp dir)")
    parser.add_argument("--warm-only", action="store_true", help="no cold (dropped page cache) loads")
    parser.add_argument("--no-s3", action="store_true", help="same as --clouds with nothing")
    parser.add_argument("--no-rss", action="store_true")
    parser.add_argument("--no-reshard", action="store_true")
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch of ranks")
    parser.add_argument(
        "--estimator",
        choices=sorted(_ESTIMATORS),
        default="median",
        help="how repetitions are aggregated: median (default) or best (the fastest run)",
    )
    parser.add_argument(
        "--from-json", metavar="IN", help="do not run: summarize the raw timings of an earlier --json output"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)["results"]
        summary = summarize(results, args.estimator)
        _report(markdown(results, summary, args.estimator) + f"\n\n(Summarized from {args.from_json}.)", args.markdown)
        return 0
    args.argv = argv
    if args.sizes is None:
        args.sizes = [64] if args.quick else [64, 256, 1024]
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    if args.cloud_sizes is None:
        args.cloud_sizes = [32] if args.quick else [32, 128]
    if args.no_s3:
        args.clouds = []
    started = time.perf_counter()
    results = run(args)
    results["seconds"] = time.perf_counter() - started
    summary = summarize(results, args.estimator)
    json_to_stdout = args.json == "-"
    _report(
        markdown(results, summary, args.estimator) + f"\n\nWall time of the benchmark: {results['seconds']:.0f} s.",
        args.markdown,
        sys.stderr if json_to_stdout else None,
    )
    if args.json:
        report = {"results": results, "summary": summary, "targets": TARGETS}
        if json_to_stdout:
            json.dump(report, sys.stdout, indent=1, default=str)
            sys.stdout.write("\n")
        else:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)
    if args.plot:
        try:
            plot(results, summary, args.plot)
        except ImportError as exc:
            print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)
    ok = all(e["ok"] for e in results["io"]) and all(r.get("ok", True) for r in results["cloud"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
