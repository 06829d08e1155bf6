"""`ckpt bench`: ckptlib against raw DCP, torch.save, the disk and the cloud SDKs, side by side in one run.

Run: ckpt bench [--quick] [--json [OUT]] [--plot OUT.png] [--sizes 64 256 1024] ...

First, this machine's ceilings (`ceilings`; `--no-ceilings` skips them, `--ceilings-only`
stops after them): parallel write + fsync and read (evicted, page cache) of incompressible data
on the scratch disk by N processes, memory copy on 1 and all threads, TCP and gloo over
loopback. Every ckptlib figure is then also reported as a % of its ceiling and as the median
(min-max) of its per-repetition ratio to the ceiling measured beside it (`ceiling_summary`).

What is measured (every number is the median over repetitions, or the fastest one with
--estimator best; one untimed warm-up round runs first; ckptlib and its baselines alternate
inside each repetition, in a rotating order, so machine noise hits all of them; each timed
operation also records its CPU time, run-queue wait and the load average, and a row whose
ranks waited for a CPU a quarter of the time or more is flagged "starved"):

- save: ckptlib.save, dcp.save (FileSystemWriter, its defaults: one file per rank, fsync)
  and a raw parallel write of the same bytes (one file per rank, write + fsync: the disk's
  limit), at each world size, for a DTensor state sharded (Shard(0)) over the ranks;
  torch.save of the full state on one rank (world size 1 rows).
- save checksums: every CRC-32 call inside the timed ckptlib.save is timed (`crc_meter`):
  its share of the save's wall and CPU time.
- load: ckptlib.load with verify=True and verify=False (the difference is the checksum
  cost), dcp.load (FileSystemReader), torch.load (world size 1), and the raw read of the
  raw write's files into the template (the read ceiling). Warm: every file is read once
  before the timed load, so all loads come from the page cache. Cold (not with --quick or
  --warm-only): the checkpoint's own files are evicted from the page cache
  (posix_fadvise DONTNEED; no root needed, other processes' caches untouched) first.
- resharded load: the checkpoint saved at N ranks loaded at M, against the one saved at M.
- peak RSS per rank: ru_maxrss of fresh rank processes that only load (or only save), next
  to the rank's shard size; the ranks are forked from a forkserver that imported torch, so
  the baseline (~the forkserver's RSS) is reported too.
- async save: how long `ckptlib.async_save(...)` blocks (first save of a process:
  staging buffers are allocated; later saves reuse them) against a synchronous save and
  against a plain copy of the shard into preallocated buffers (the staging ceiling); and
  with `background_staging=True`, how long it blocks and when `wait_staged()` returns.
- cloud storage (S3 on moto, GCS on fake-gcs-server, Azure on Azurite, all on 127.0.0.1):
  ckptlib save/load against each SDK's own plain upload/download of the same bytes per rank.

Throughput is state bytes / wall time of the slowest rank (barriers around every timed op;
every timed save starts after an untimed `os.sync()`, so it waits for its own writeback only).
Scratch checkpoints go to a temporary directory (--dir) that is removed at the end.

Exit status: 0 when every load returned exactly the values saved, 1 when one did not (timings
and missed targets never change it), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from ckptlib.bench import counted, help_description
from ckptlib.bench.ceilings import measure as measure_ceilings
from ckptlib.bench.cloud_sdk import run_cloud
from ckptlib.bench.paired import load_average
from ckptlib.bench.reshard_load import rank_reshard
from ckptlib.bench.throughput_summary import ESTIMATORS, TARGETS, markdown, summarize


def _max_over_ranks(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    """Per repetition, the slowest rank (they are equal up to the barrier's skew)."""
    columns = [r["times"].get(key, []) for r in per_rank]
    return [max(vals) for vals in zip(*columns)] if all(columns) else []


def _per_rank(per_rank: list[dict[str, Any]], field: str) -> dict[str, list]:
    """{key: [rank 0's list, rank 1's, ...]} of a per-rank dict field (every raw number kept)."""
    keys = per_rank[0].get(field, {})
    return {key: [r[field].get(key, []) for r in per_rank] for key in keys}


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ckptlib.bench.local_io import rank_io, rank_rss  # torch: not needed for --help
    from ckptlib.testing import launch

    cold = (not args.quick) and (not args.warm_only) and hasattr(os, "posix_fadvise")
    root = tempfile.mkdtemp(prefix="ckptlib-bench-", dir=args.dir)
    args.scratch = root
    results: dict[str, Any] = {
        "command": "ckpt bench " + " ".join(args.argv),
        "commit": _commit(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "load_average": {"start": load_average()},
        "ceilings": None,
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
            "loads are from the page cache only" + ("" if hasattr(os, "posix_fadvise") else " (no posix_fadvise here)")
        )
    try:
        if not args.no_ceilings:
            results["ceilings"] = measure_ceilings(args, launch, _log)
        if args.ceilings_only:
            return results
        import torch

        results["machine"]["torch"] = torch.__version__
        from ckptlib.format.items import checksum

        results["machine"]["crc32"] = getattr(checksum.crc32, "__module__", "zlib") or "zlib"
        for size in args.sizes:
            kept: dict[int, str] = {}
            for ws in args.world_sizes:
                keep = f"{root}/keep-{size}-w{ws}"
                _log(f"io: {size} MiB at {counted(ws, 'rank')}")
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
                    "usage": _per_rank(out, "usage"),
                    "crc": [r["crc"] for r in out],
                    "load_average": load_average(),
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
                    _log(f"reshard: {size} MiB into {counted(m, 'rank')}")
                    modes = [True] if args.quick else [True, False]
                    out = launch(m, rank_reshard, kept, size, args.reps, modes, timeout=args.timeout)
                    usage = _per_rank(out, "usage")
                    for n in args.world_sizes:
                        for verify in modes:
                            key = f"{n}:{int(verify)}"
                            results["reshard"].append(
                                {
                                    "size_mib": size,
                                    "saved": n,
                                    "loaded": m,
                                    "verify": verify,
                                    "times": _max_over_ranks(out, key),
                                    "usage": usage.get(key, []),
                                    "load_average": load_average(),
                                }
                            )
            if not args.no_rss:
                for ws in args.world_sizes:
                    _log(f"rss: {size} MiB at {counted(ws, 'rank')}")
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
            results["cloud"] = run_cloud(args, launch, _log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        results["load_average"]["end"] = load_average()
    return results


def _commit() -> str | None:
    """The source checkout's commit (with "+dirty" for uncommitted changes), or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _report(text: str, markdown_path: str | None, stream=None) -> None:
    print(text, file=stream or sys.stdout)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(text + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ckpt bench",
        description=help_description(__doc__).removeprefix("`ckpt bench`: "),
        epilog="The other benchmarks: ckpt bench scale --help (coordinator cost at simulated world sizes), "
        "ckpt bench tensors --help (time per tensor count), ckpt bench async --help (a training loop during "
        "an async save), ckpt bench read-once --help (storage bytes read by replicated loads).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB only, 2 repetitions, cloud at 32 MiB, no cold loads (1-5 minutes)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", help="state sizes in MiB (default 64 256 1024)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="ranks (default 1 2 4)")
    parser.add_argument(
        "--reps", type=int, help="timed repetitions, after an untimed warm-up round (default 5; --quick: 2)"
    )
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
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS launches")
    parser.add_argument("--no-reshard", action="store_true", help="skip the resharded loads")
    parser.add_argument("--no-async", action="store_true", help="skip the async saves")
    parser.add_argument("--no-ceilings", action="store_true", help="do not measure the machine's ceilings first")
    parser.add_argument("--ceilings-only", action="store_true", help="measure the machine's ceilings and stop")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch of ranks")
    parser.add_argument(
        "--estimator",
        choices=sorted(ESTIMATORS),
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
        args.reps = 2 if args.quick else 5
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
            from ckptlib.bench.throughput_plot import plot

            plot(results, summary, args.plot)
        except ImportError as exc:
            print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)
    ok = all(e["ok"] for e in results["io"]) and all(r.get("ok", True) for r in results["cloud"])
    return 0 if ok else 1
