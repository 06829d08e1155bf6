"""A training loop's step time while an async save runs: no save, async_mode="thread", "process".

One process, `torch.set_num_threads(1)`: each step is `--ops` rounds of `x = tanh(x @ w)` on
a (64, `--width`) activation, a CPU-bound loop that, like a real one, spends part of its time in
Python (and so needs the GIL). Each repetition runs the three modes in a rotating order
(none, thread, process; then thread, process, none; ...). A save mode calls `ckptlib.async_save`
on a state of `--mib` MiB in `--tensors` float32 tensors and steps until the save has committed
(at least `--min-steps` steps); "none" runs `--none-steps` steps. Before the repetitions, one untimed save per save mode
starts the writer process and fills the staging buffers (the steady state a training run is
in); its time is reported as start-up.

Reported per mode: the median step time over the steps that overlapped the save (every step
for "none"), its ratio to "none" within the same repetition (median over repetitions; target
"process" <= 1.1x), the 90th percentile step, how long `async_save` blocked the loop (staging),
and the save's total time to its commit. The last checkpoint of each mode is loaded back and
compared bit-exactly (exit status 1 otherwise). The load average is printed with the table:
on a shared machine the writer process competes with everyone else for the spare cores.

Run: ckpt bench async [--mib 256] [--tensors 256] [--reps 5] [--width 256] [--ops 40]
                      [--min-steps 20] [--none-steps 50] [--json [OUT]] [--dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ckptlib.bench import counted, help_description

MODES = ("none", "thread", "process")
TARGET_RATIO = 1.1  # process-mode step time <= 1.1x the step time without a save


def _log(msg: str) -> None:
    print(f"[bench async {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_state(mib: int, tensors: int) -> dict[str, Any]:
    """`tensors` float32 tensors of `mib` MiB in all (seeded values), plus a step counter."""
    import torch

    gen = torch.Generator().manual_seed(0)
    per = max(1, (mib << 20) // 4 // tensors)
    return {"params": {f"t{i}": torch.rand(per, generator=gen) for i in range(tensors)}, "step": 0}


class Loop:
    """The training loop: `step()` returns its own duration in seconds."""

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


def _run_mode(mode: str, loop: Loop, state: dict, target: str, args: argparse.Namespace) -> dict[str, Any]:
    import ckptlib

    if mode == "none":
        return {"mode": mode, "steps": [loop.step() for _ in range(args.none_steps)]}
    handle = ckptlib.async_save(target, state, step=int(state["step"]), async_mode=mode)
    times = []
    while not handle.done() or len(times) < args.min_steps:
        times.append(loop.step())
    result = handle.wait()
    return {"mode": mode, "steps": times, "blocking": handle.blocking_seconds, "save": result.seconds}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import ckptlib
    from ckptlib.saving import background_save, writer_process

    torch.set_num_threads(1)
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-async-", dir=args.dir)
    state = make_state(args.mib, args.tensors)
    loop = Loop(args.width, args.ops)
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "argv"}, "reps": []}
    report["load_before"] = os.getloadavg()
    ok = True
    try:
        for _ in range(3):
            loop.step()  # warm the loop
        startup = {}
        for mode in ("thread", "process"):
            started = time.perf_counter()
            ckptlib.async_save(os.path.join(scratch, f"warm-{mode}"), state, async_mode=mode).wait()
            startup[mode] = time.perf_counter() - started
            shutil.rmtree(os.path.join(scratch, f"warm-{mode}"))
        report["first_save"] = startup
        writer = writer_process.current()
        report["process_fallback"] = writer is None
        for rep in range(args.reps):
            order = MODES[rep % 3 :] + MODES[: rep % 3]
            runs: dict[str, Any] = {}
            state["step"] = rep + 1
            for mode in order:
                runs[mode] = _run_mode(mode, loop, state, os.path.join(scratch, f"{mode}-{rep}"), args)
            report["reps"].append({"order": list(order), "runs": runs})
            _log(f"rep {rep + 1}/{args.reps}: " + ", ".join(_brief(runs[m]) for m in order))
            for mode in ("thread", "process"):
                if rep < args.reps - 1:
                    shutil.rmtree(os.path.join(scratch, f"{mode}-{rep}"))
        last = args.reps - 1
        for mode in ("thread", "process"):
            got = make_state(args.mib, args.tensors)
            for value in got["params"].values():
                value.zero_()
            ckptlib.load(os.path.join(scratch, f"{mode}-{last}"), got)
            same = all(torch.equal(got["params"][k], v) for k, v in state["params"].items())
            ok = ok and same and got["step"] == last + 1
    finally:
        background_save.release_staging()
        shutil.rmtree(scratch, ignore_errors=True)
    report["load_after"] = os.getloadavg()
    report["ok"] = ok
    return report


def _brief(run: dict[str, Any]) -> str:
    return f"{run['mode']} {statistics.median(run['steps']) * 1e3:.2f} ms x{len(run['steps'])}"


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        runs = [rep["runs"][mode] for rep in report["reps"]]
        ratios = [
            statistics.median(rep["runs"][mode]["steps"]) / statistics.median(rep["runs"]["none"]["steps"])
            for rep in report["reps"]
        ]
        every = [t for r in runs for t in r["steps"]]
        rows.append(
            {
                "mode": mode,
                "step_ms": statistics.median(every) * 1e3,
                "p90_step_ms": statistics.quantiles(every, n=10)[-1] * 1e3 if len(every) > 1 else every[0] * 1e3,
                "ratio": statistics.median(ratios),
                "steps": statistics.median(len(r["steps"]) for r in runs),
                "blocking_ms": statistics.median(r["blocking"] for r in runs) * 1e3 if mode != "none" else None,
                "save_s": statistics.median(r["save"] for r in runs) if mode != "none" else None,
            }
        )
    return rows


def markdown(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    args = report["args"]
    lines = [
        f"Step time while an async save of {args['mib']} MiB ({counted(args['tensors'], 'tensor')}) runs; "
        f"{counted(args['reps'], 'repetition')}, modes interleaved; loop: {args['ops']} x tanh((64, {args['width']}) @ "
        f"({args['width']}, {args['width']})), 1 thread.",
        "",
        "| mode | median step (ms) | x no save | p90 step (ms) | steps during save | blocked (ms) | save (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        blocked = "" if row["blocking_ms"] is None else f"{row['blocking_ms']:.1f}"
        save = "" if row["save_s"] is None else f"{row['save_s']:.2f}"
        lines.append(
            f"| {row['mode']} | {row['step_ms']:.2f} | {row['ratio']:.2f}x | {row['p90_step_ms']:.2f} | "
            f"{row['steps']:.0f} | {blocked} | {save} |"
        )
    first = report["first_save"]
    lines += [
        "",
        f"First save (untimed warm-up, includes start-up): thread {first['thread']:.2f} s, process "
        f"{first['process']:.2f} s. Target: process <= {TARGET_RATIO}x. Load average before/after: "
        f"{'/'.join(f'{v:.1f}' for v in report['load_before'])} / "
        f"{'/'.join(f'{v:.1f}' for v in report['load_after'])} ({os.cpu_count()} CPUs).",
    ]
    if report["process_fallback"]:
        lines.append('async_mode="process" is not available here: its row measured the thread fallback.')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ckpt bench async",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--tensors", type=int, default=256, help="tensors in the state (default 256)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the three modes (default 5)")
    parser.add_argument("--width", type=int, default=256, help="the loop's matrix width (default 256)")
    parser.add_argument("--ops", type=int, default=40, help="matmul+tanh rounds per step (default 40)")
    parser.add_argument("--min-steps", type=int, default=20, help="fewest steps per save (default 20)")
    parser.add_argument("--none-steps", type=int, default=50, help="steps without a save per repetition (default 50)")
    parser.add_argument(
        "--json",
        metavar="OUT",
        nargs="?",
        const="-",
        help="write raw step times and the summary as JSON to OUT, or to stdout without OUT "
        "(the table then goes to stderr)",
    )
    parser.add_argument("--dir", help="scratch directory (default: the system temp dir)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 MiB, 32 tensors, 2 repetitions")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.tensors, args.reps, args.min_steps, args.none_steps = 8, 32, 2, 5, 10
    started = time.perf_counter()
    report = run(args)
    report["seconds"] = time.perf_counter() - started
    rows = summarize(report)
    to_stdout = args.json == "-"
    print(
        markdown(report, rows) + f"\n\nWall time of the benchmark: {report['seconds']:.0f} s.",
        file=sys.stderr if to_stdout else sys.stdout,
    )
    if args.json:
        out = {"results": report, "summary": rows}
        if to_stdout:
            json.dump(out, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
