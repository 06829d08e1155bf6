"""A training loop's step time, the first save's latency and the memory of async saves:
no save, async_mode="thread" and "process", at 1, 2 and 4 ranks.

Each rank (`ckptlib.testing.launch`, gloo; `torch.set_num_threads(1)`) holds a shard of
`--mib` MiB in `--tensors` float32 DTensors (Shard(0)) and runs two loops: "cpu", `--ops`
rounds of `x = tanh(x @ w)` on a (64, `--width`) activation (CPU-bound, partly in Python, so it
needs the GIL), and "io", `--io-ops` such rounds then `--io-wait-ms` of waiting with the GIL
released (a GPU-bound step as the host sees it). Each repetition runs, per loop, the three modes
in a rotating order (none, thread, process; then thread, process, none; ...): a save mode calls
`ckptlib.async_save` and steps until the save has committed (at least `--min-steps` steps);
"none" runs `--none-steps` steps. One untimed save per mode first starts the writer and fills
the staging buffers (the steady state of a training run).

Reported per ranks, loop and mode: the median step during the save, its ratio to "none" of the
same repetition and loop (median over repetitions and ranks; target "process" <= 1.1x on the
cpu loop), the 90th percentile step, how long `async_save` blocked and the save's time to its
commit. Per mode, from a cold start (no writer process, no staging buffers; `--first-reps`
times, interleaved): the first-save latency, from `CheckpointManager(async_save=AsyncMode(mode))`
to the first save committed (the writer process's start-up included), and the peak resident
bytes of the rank plus its writer process on the way (VmRSS of the rank, RssAnon + RssFile of
the writer: the shared staging is counted once), also over the rank's own before the manager.
Staging memory, per mode without and with `AsyncMode(max_staging_bytes=--cap-mib)`: the peak
resident bytes of one save (fresh staging buffers, the writer already running) over those before
it, and the save's staging high-water mark (`SaveResult.staging_peak_bytes`), against the shard.
The last checkpoint of each mode is loaded back and compared bit-exactly (exit status 1
otherwise). The load average is printed with the tables: on a shared machine the writer
processes compete with everyone else for the spare cores.

Run: ckpt bench async [--ranks 1 2 4] [--mib 128] [--tensors 128] [--reps 3] [--first-reps 2]
                      [--cap-mib 16] [--width 256] [--ops 40] [--io-ops 4] [--io-wait-ms 20] [--min-steps 20]
                      [--none-steps 40] [--json [OUT]] [--dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ckptlib.bench import counted, emit, help_description
from ckptlib.bench.async_ranks import LOOPS, MODES, SAVE_MODES, rank_async, ratio

TARGET_RATIO = 1.1  # process-mode step time on the cpu loop <= 1.1x the step time without a save
MiB = 1 << 20


def _log(msg: str) -> None:
    print(f"[bench async {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "mib",
        "tensors",
        "reps",
        "first_reps",
        "cap_mib",
        "width",
        "ops",
        "io_ops",
        "io_wait_ms",
        "min_steps",
        "none_steps",
    )
    return {name: getattr(args, name) for name in names}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ckptlib.saving.staging_arena import unavailable_reason
    from ckptlib.testing import launch

    report: dict[str, Any] = {
        "command": "ckpt bench async " + " ".join(args.argv),
        "args": _config(args),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "process_unavailable": unavailable_reason(),
        "load_before": os.getloadavg(),
        "worlds": {},
    }
    for world in args.ranks:
        scratch = tempfile.mkdtemp(prefix="ckpt-bench-async-", dir=args.dir)
        _log(f"{counted(world, 'rank')}, load average {'/'.join(f'{v:.1f}' for v in os.getloadavg())}")
        try:
            report["worlds"][str(world)] = launch(world, rank_async, _config(args), scratch, timeout=args.timeout)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    report["load_after"] = os.getloadavg()
    report["ok"] = all(r["ok"] for ranks in report["worlds"].values() for r in ranks)
    return report


def summarize(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    steps, first, memory = [], [], []
    for world, ranks in report["worlds"].items():
        for loop in LOOPS:
            for mode in MODES:
                runs = [rep[loop] for r in ranks for rep in r["reps"]]
                every = [t for run in runs for t in run[mode]["steps"]]
                row = {
                    "ranks": int(world),
                    "loop": loop,
                    "mode": mode,
                    "step_ms": statistics.median(every) * 1e3,
                    "p90_step_ms": statistics.quantiles(every, n=10)[-1] * 1e3,
                    "ratio": statistics.median(ratio(run, mode) for run in runs),
                    "worst_ratio": max(ratio(run, mode) for run in runs),
                    "blocking_ms": None,
                    "save_s": None,
                }
                if mode != "none":
                    row["blocking_ms"] = statistics.median(run[mode]["blocking"] for run in runs) * 1e3
                    row["save_s"] = statistics.median(run[mode]["save"] for run in runs)
                steps.append(row)
        for mode in SAVE_MODES:
            reps = range(len(ranks[0]["first"][mode]))
            first.append(
                {
                    "ranks": int(world),
                    "mode": mode,
                    # per repetition the slowest rank, its peak the largest
                    "first_save_s": statistics.median(max(r["first"][mode][i]["seconds"] for r in ranks) for i in reps),
                    "peak_mib": statistics.median(max(r["first"][mode][i]["peak"] for r in ranks) for i in reps) / MiB,
                    "over_mib": statistics.median(max(r["first"][mode][i]["over"] for r in ranks) for i in reps) / MiB,
                    "shard_mib": ranks[0]["shard_bytes"] / MiB,
                }
            )
        for i, case in enumerate(ranks[0]["memory"]):
            shard = ranks[0]["shard_bytes"]
            memory.append(
                {
                    "ranks": int(world),
                    "mode": case["mode"],
                    "cap_mib": None if case["cap"] is None else case["cap"] / MiB,
                    "over_x_shard": max(r["memory"][i]["over"] for r in ranks) / shard,
                    "staging_x_shard": max(r["memory"][i]["staging_peak"] for r in ranks) / shard,
                    "shard_mib": shard / MiB,
                }
            )
    return {"steps": steps, "first": first, "memory": memory}


def markdown(report: dict[str, Any], rows: dict[str, list[dict[str, Any]]]) -> str:
    args = report["args"]
    lines = [
        f"Step time while an async save of {args['mib']} MiB a rank ({counted(args['tensors'], 'tensor')}) runs; "
        f"{counted(args['reps'], 'repetition')}, modes interleaved; loops: cpu = {args['ops']} x "
        f"tanh((64, {args['width']}) @ ({args['width']}, {args['width']})), io = {args['io_ops']} such rounds + "
        f"{args['io_wait_ms']:g} ms waiting; 1 thread a rank.",
        "",
        "| ranks | loop | mode | median step (ms) | x no save | worst rank-rep | p90 step (ms) | blocked (ms) "
        "| save (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows["steps"]:
        blocked = "" if row["blocking_ms"] is None else f"{row['blocking_ms']:.1f}"
        save = "" if row["save_s"] is None else f"{row['save_s']:.2f}"
        lines.append(
            f"| {row['ranks']} | {row['loop']} | {row['mode']} | {row['step_ms']:.2f} | {row['ratio']:.2f}x | "
            f"{row['worst_ratio']:.2f}x | {row['p90_step_ms']:.2f} | {blocked} | {save} |"
        )
    lines += [
        "",
        f"First save from a cold start ({counted(args['first_reps'], 'repetition')}, slowest rank): "
        "`CheckpointManager(async_save=AsyncMode(mode))` to the first save committed, and the peak "
        "resident memory of the rank plus its writer process on the way.",
        "",
        "| ranks | mode | first save (s) | peak resident (MiB) | over the rank before (MiB) | shard (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows["first"]:
        lines.append(
            f"| {row['ranks']} | {row['mode']} | {row['first_save_s']:.2f} | {row['peak_mib']:.0f} | "
            f"{row['over_mib']:.0f} | {row['shard_mib']:.0f} |"
        )
    lines += [
        "",
        "Host memory of one save against the shard (the largest rank): its peak resident bytes over "
        "the rank's and its writer's before it, and its staging high-water mark.",
        "",
        "| ranks | mode | max_staging_bytes | peak over before (x shard) | staging peak (x shard) | shard (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows["memory"]:
        cap = "none" if row["cap_mib"] is None else f"{row['cap_mib']:g} MiB"
        lines.append(
            f"| {row['ranks']} | {row['mode']} | {cap} | {row['over_x_shard']:.2f} | {row['staging_x_shard']:.3f} | "
            f"{row['shard_mib']:.0f} |"
        )
    lines += [
        "",
        f"Target: process <= {TARGET_RATIO}x on the cpu loop. Load average before/after: "
        f"{'/'.join(f'{v:.1f}' for v in report['load_before'])} / "
        f"{'/'.join(f'{v:.1f}' for v in report['load_after'])} ({os.cpu_count()} CPUs).",
    ]
    if report["process_unavailable"]:
        lines.append(
            f'async_mode="process" is not available here ({report["process_unavailable"]}): '
            "its rows measured the thread fallback."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ckpt bench async",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    parser.add_argument("--mib", type=int, default=128, help="shard size a rank in MiB (default 128)")
    parser.add_argument("--tensors", type=int, default=128, help="tensors in the state (default 128)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the three modes (default 3)")
    parser.add_argument("--first-reps", type=int, default=2, help="cold first saves per mode (default 2)")
    parser.add_argument(
        "--cap-mib", type=int, default=16, help="max_staging_bytes of the capped memory case, MiB (default 16)"
    )
    parser.add_argument("--width", type=int, default=256, help="the loops' matrix width (default 256)")
    parser.add_argument("--ops", type=int, default=40, help="matmul+tanh rounds per cpu step (default 40)")
    parser.add_argument("--io-ops", type=int, default=4, help="matmul+tanh rounds per io step (default 4)")
    parser.add_argument("--io-wait-ms", type=float, default=20.0, help="waiting per io step in ms (default 20)")
    parser.add_argument("--min-steps", type=int, default=20, help="fewest steps per save (default 20)")
    parser.add_argument("--none-steps", type=int, default=40, help="steps without a save per repetition (default 40)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch of ranks (default 3600)")
    parser.add_argument(
        "--json",
        metavar="OUT",
        nargs="?",
        const="-",
        help="write raw step times and the summary as JSON to OUT, or to stdout without OUT "
        "(the table then goes to stderr)",
    )
    parser.add_argument("--dir", help="scratch directory (default: the system temp dir)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 8 MiB, 16 tensors, 1 repetition, 1 cold save, a 2 MiB cap, ranks 1 2",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    if args.quick:
        vars(args).update(mib=8, tensors=16, reps=1, first_reps=1, cap_mib=2, min_steps=5, none_steps=10, ranks=[1, 2])
    started = time.perf_counter()
    report = run(args)
    report["seconds"] = time.perf_counter() - started
    rows = summarize(report)
    text = markdown(report, rows) + f"\n\nWall time of the benchmark: {report['seconds']:.0f} s."
    emit(text, {"results": report, "summary": rows}, args.json)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
