"""How fast is the distributed test harness? The CPU elastic matrix against a fresh-spawn baseline.

    python -m ckptlib.bench.launch_speed [--json OUT] [--no-matrix] [-k EXPR]

In one run, alternating:
- fresh spawn: `torch.multiprocessing.start_processes(..., start_method="spawn")` of 4 ranks
  that init a gloo group, all_reduce once and destroy it (every rank imports torch);
- harness launch: the same body through `ckptlib.testing.launch` (forkserver with preloads),
  first launch (starts the forkserver) and later ones;
- the whole CPU elastic matrix: `pytest tests/elastic/test_elastic.py` in a subprocess, its wall
  time, its case count and the per-case call times (`--durations=0`); it needs a source checkout
  (the tests are not in the wheel), --no-matrix skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

#: The source checkout this ckptlib runs from (its tests/ hold the elastic matrix).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATRIX = "tests/elastic/test_elastic.py"


def _body() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def _spawned(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _body()
    dist.destroy_process_group()


def fresh_spawn(world: int = 4) -> float:
    import torch.multiprocessing as tmp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.perf_counter()
    tmp.start_processes(_spawned, args=(world, port), nprocs=world, start_method="spawn", join=True)
    return time.perf_counter() - t0


def harness_launch(world: int = 4) -> float:
    from ckptlib.testing import launch

    t0 = time.perf_counter()
    launch(world, _body)
    return time.perf_counter() - t0


def elastic_matrix(k: str | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        MATRIX,
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=0",
    ]
    if k:
        cmd += ["-k", k]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout
    calls = [float(m.group(1)) for m in re.finditer(r"^\s*([\d.]+)s call\s+\S+", out, re.M)]
    setups = [float(m.group(1)) for m in re.finditer(r"^\s*([\d.]+)s setup\s+\S+", out, re.M)]
    summary = re.search(r"(\d+) passed[^\n]*? in ([\d.]+)s", out)
    failed = re.search(r"(\d+) failed", out)
    return {
        "command": " ".join(cmd[1:]),
        "returncode": proc.returncode,
        "wall_s": wall,
        "pytest_s": float(summary.group(2)) if summary else None,
        "passed": int(summary.group(1)) if summary else 0,
        "failed": int(failed.group(1)) if failed else 0,
        "call_s": calls,
        "setup_s": setups,
        "tail": out.strip().splitlines()[-1:] if out.strip() else [],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptlib.bench.launch_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="OUT", help="also write the raw timings as JSON to OUT")
    parser.add_argument("--no-matrix", action="store_true", help="only the spawn and launch timings")
    parser.add_argument("-k", help="pytest -k expression for the matrix (default: all of it)")
    args = parser.parse_args(argv)
    if not args.no_matrix and not os.path.isfile(os.path.join(ROOT, MATRIX)):
        parser.error(f"the elastic matrix needs a source checkout (no {MATRIX} under {ROOT}); --no-matrix skips it")

    spawn, launches = [], []
    spawn.append(fresh_spawn())
    first = harness_launch()  # starts the forkserver (imports torch once)
    for _ in range(3):
        launches.append(harness_launch())
        spawn.append(fresh_spawn())
    matrix = None if args.no_matrix else elastic_matrix(args.k)
    spawn.append(fresh_spawn())
    launches.append(harness_launch())

    res = {
        "fresh_spawn_4_s": spawn,
        "harness_first_launch_4_s": first,
        "harness_launch_4_s": launches,
        "matrix": matrix,
    }
    med_spawn, med_launch = statistics.median(spawn), statistics.median(launches)
    lines = [
        "| measurement | seconds |",
        "|---|---:|",
        f"| fresh `spawn` of 4 gloo ranks (init, all_reduce, destroy), median of {len(spawn)} | {med_spawn:.2f} |",
        f"| harness `launch` of the same, first (starts the forkserver) | {first:.2f} |",
        f"| harness `launch` of the same, later, median of {len(launches)} | {med_launch:.2f} |",
    ]
    if matrix:
        calls = matrix["call_s"]
        cases = matrix["passed"] + matrix["failed"]
        lines += [
            f"| whole CPU elastic matrix: `{matrix['command']}` wall ({cases} cases, rc {matrix['returncode']}) "
            f"| {matrix['wall_s']:.1f} |",
            f"| per case: wall / cases | {matrix['wall_s'] / max(1, cases):.2f} |",
            f"| per case: median call time (a load launch, plus a save launch for the first case of each save) "
            f"| {statistics.median(calls) if calls else float('nan'):.2f} |",
            f"| per case: max call time | {max(calls) if calls else float('nan'):.2f} |",
            f"| matrix cases in the time of one fresh spawn each | {cases * med_spawn:.0f} s |",
        ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if not matrix or matrix["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
