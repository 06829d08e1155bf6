"""Save and load time per tensor count: ckptlib against raw DCP, side by side in one run.

A transformer-shaped state: the parameters of `layers` blocks (four hidden x hidden attention
matrices, three MLP matrices, eleven norm/bias vectors; hidden 80, so ~14 KiB a tensor on
average) and both AdamW moments of every parameter (`exp_avg`, `exp_avg_sq`), cut to exactly
`tensors` tensors in all; every tensor a DTensor, Shard(0) over the ranks. In each repetition
ckptlib.save and dcp.save (FileSystemWriter) alternate in a rotating order, then
ckptlib.load (verify=True) and dcp.load (FileSystemReader) from the page cache; every load is
into a zeroed template and checked bit-exact against the saved state (exit code 1 otherwise).

Run: ckpt bench tensors [--tensors 16 1000 10000] [--world-sizes 1 2 4] [--reps 3]
                        [--json [OUT]] [--dir DIR] [--ablation]

--ablation adds two more methods to every repetition, to show what the garbage-collector pause
is worth on each side: raw DCP inside `ckptlib._runtime.gc_pause.gc_paused` ("dcp-gc-paused"), and
ckptlib with its pause replaced by a no-op ("ckptlib-gc-on").
Every number is the slowest rank's wall time (barriers around each timed call), median over
the repetitions; "ms/tensor" is that time divided by the tensor count of the whole state.
Scratch checkpoints go to a temporary directory (--dir) that is removed at the end.

Exit status: 0 when every load was bit-exact, 1 when one was not, 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ckptlib.bench import counted, emit, help_description
from ckptlib.bench.rank_ops import barrier, rank_world, remove_tree, settle, timed, warm

HIDDEN = 80
TARGET_RATIO = 1.0  # ckptlib time <= 1.0x raw DCP's at every tensor count ...
TARGET_RATIO_LARGE = 0.5  # ... and <= 0.5x from LARGE tensors on
LARGE = 10_000


def parameter_shapes(count: int) -> list[tuple[int, ...]]:
    """The shapes of a transformer's first `count` parameters, block after block."""
    h = HIDDEN
    block = [(h, h)] * 4 + [(2 * h, h), (h, 2 * h), (2 * h, h)] + [(h,)] * 11
    return [block[i % len(block)] for i in range(count)]


def make_state(tensors: int, fill: bool) -> dict[str, Any]:
    """{"model": {name: DTensor}, "optim": {name: {"exp_avg", "exp_avg_sq"}}}, `tensors` in all."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = parameter_shapes(-(-tensors // 3))
    names = [f"layers.{i // 18}.p{i % 18}" for i in range(len(shapes))]
    gen = torch.Generator().manual_seed(rank)
    state: dict[str, Any] = {"model": {}, "optim": {}}
    made = 0
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        for name, shape in zip(names, shapes):
            if made == tensors:
                break
            local_shape = (shape[0] // world, *shape[1:])
            local = torch.rand(local_shape, generator=gen) if fill else torch.zeros(local_shape)
            tensor = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride()
            )
            if kind == "weight":
                state["model"][name] = tensor
            else:
                state["optim"].setdefault(name, {})[kind] = tensor
            made += 1
    return state


def _leaves(state: dict[str, Any]) -> list[Any]:
    return list(state["model"].values()) + [t for moments in state["optim"].values() for t in moments.values()]


def _method_context(method: str):
    """The garbage-collector setting a method runs under (see --ablation)."""
    import contextlib
    from unittest import mock

    from ckptlib._runtime.gc_pause import gc_paused

    if method == "dcp-gc-paused":
        return gc_paused()
    if method == "ckptlib-gc-on":
        stack = contextlib.ExitStack()
        for module in ("ckptlib.saving.saving", "ckptlib.loading.loading"):
            stack.enter_context(mock.patch(f"{module}.gc_paused", contextlib.nullcontext))
        return stack
    return contextlib.nullcontext()


def rank_tensors(root: str, tensors: int, reps: int, ablation: bool = False) -> dict[str, Any]:
    """Saves and loads of one (tensor count, world size), ckptlib and DCP interleaved."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptlib

    rank, _ = rank_world()
    state = make_state(tensors, fill=True)
    template = make_state(tensors, fill=False)
    times: dict[str, list[float]] = {}
    ok = True
    methods = ["ckptlib", "dcp"] + (["dcp-gc-paused", "ckptlib-gc-on"] if ablation else [])
    for rep in range(reps):
        base = f"{root}/rep{rep}"
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for method in order:
            path = f"{base}/{method}"
            settle()
            with _method_context(method):
                if method.startswith("ckptlib"):
                    seconds = timed(lambda: ckptlib.save(path, state))
                else:
                    seconds = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path)))
            times.setdefault(f"save_{method}", []).append(seconds)
        for method in order:
            path = f"{base}/{method}"
            with torch.no_grad():
                for t in _leaves(template):
                    t.to_local().zero_()
            warm(path)
            with _method_context(method):
                if method.startswith("ckptlib"):
                    seconds = timed(lambda: ckptlib.load(path, template))
                else:
                    seconds = timed(lambda: dcp.load(template, storage_reader=dcp.FileSystemReader(path)))
            times.setdefault(f"load_{method}", []).append(seconds)
            ok = ok and all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(_leaves(state), _leaves(template)))
        remove_tree(base)
    barrier()
    shard = sum(t.to_local().numel() * t.to_local().element_size() for t in _leaves(state))
    return {"rank": rank, "times": times, "ok": ok, "shard_bytes": shard}


def _source_commit() -> str:
    """`git describe` of the source checkout ckptlib runs from ("" for an installed wheel)."""
    import subprocess

    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=checkout
        ).stdout.strip()
    except OSError:  # no git here
        return ""


def _log(msg: str) -> None:
    print(f"[bench tensors {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ckptlib.testing import launch

    root = tempfile.mkdtemp(prefix="ckptlib-bench-tensors-", dir=args.dir)
    commit = _source_commit()
    results: dict[str, Any] = {
        "command": "ckpt bench tensors " + " ".join(args.argv),
        "commit": commit or None,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_at_start": os.getloadavg(),
        },
        "reps": args.reps,
        "rows": [],
    }
    try:
        for tensors in args.tensors:
            for world in args.world_sizes:
                _log(f"{counted(tensors, 'tensor')} at {counted(world, 'rank')}")
                out = launch(
                    world,
                    rank_tensors,
                    f"{root}/t{tensors}-w{world}",
                    tensors,
                    args.reps,
                    args.ablation,
                    timeout=args.timeout,
                )
                times = {
                    key: [max(r["times"][key][i] for r in out) for i in range(args.reps)] for key in out[0]["times"]
                }
                results["rows"].append(
                    {
                        "tensors": tensors,
                        "world": world,
                        "ok": all(r["ok"] for r in out),
                        "state_bytes": sum(r["shard_bytes"] for r in out),
                        "times": times,
                    }
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    return results


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row: median seconds, ms per tensor and ckptlib / DCP ratios, with the target verdict."""
    rows = []
    for row in results["rows"]:
        t = {key: statistics.median(values) for key, values in row["times"].items()}
        n = row["tensors"]
        limit = TARGET_RATIO_LARGE if n >= LARGE else TARGET_RATIO
        out = {
            "tensors": n,
            "world": row["world"],
            "state_mib": row["state_bytes"] / (1 << 20),
            "ok": row["ok"],
            "limit": limit,
        }
        for op in ("save", "load"):
            ours, theirs = t[f"{op}_ckptlib"], t[f"{op}_dcp"]
            out[f"{op}_ckptlib_s"], out[f"{op}_dcp_s"] = ours, theirs
            out[f"{op}_ckptlib_ms_per_tensor"], out[f"{op}_dcp_ms_per_tensor"] = 1e3 * ours / n, 1e3 * theirs / n
            out[f"{op}_ratio"] = ours / theirs
            out[f"{op}_met"] = ours / theirs <= limit
            for method in ("dcp-gc-paused", "ckptlib-gc-on"):
                if f"{op}_{method}" in t:
                    out[f"{op}_{method}_s"] = t[f"{op}_{method}"]
        rows.append(out)
    return rows


def ablation_markdown(rows: list[dict[str, Any]]) -> str:
    """Seconds of every method with --ablation, and ckptlib against raw DCP with the collector
    paused on both sides."""
    lines = [
        "| tensors | ranks | op | ckptlib s | ckptlib, collector on s | raw DCP s | raw DCP, collector paused s "
        "| ckptlib / DCP paused |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for op in ("save", "load"):
            paused, gc_on = r.get(f"{op}_dcp-gc-paused_s"), r.get(f"{op}_ckptlib-gc-on_s")
            if paused is None or gc_on is None:
                continue
            lines.append(
                f"| {r['tensors']} | {r['world']} | {op} | {r[f'{op}_ckptlib_s']:.3f} | {gc_on:.3f} "
                f"| {r[f'{op}_dcp_s']:.3f} | {paused:.3f} | {r[f'{op}_ckptlib_s'] / paused:.2f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| tensors | ranks | state MiB | op | ckptlib s | raw DCP s | ckptlib ms/tensor | DCP ms/tensor | ckptlib/DCP "
        "| target | bit-exact |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        for op in ("save", "load"):
            verdict = ("met" if r[f"{op}_met"] else "missed") + f" (≤ {r['limit']})"
            lines.append(
                f"| {r['tensors']} | {r['world']} | {r['state_mib']:.1f} | {op} | {r[f'{op}_ckptlib_s']:.3f} "
                f"| {r[f'{op}_dcp_s']:.3f} | {r[f'{op}_ckptlib_ms_per_tensor']:.3f} "
                f"| {r[f'{op}_dcp_ms_per_tensor']:.3f} "
                f"| {r[f'{op}_ratio']:.2f} | {verdict} | {'yes' if r['ok'] else 'NO'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ckpt bench tensors",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tensors",
        type=int,
        nargs="+",
        default=[16, 1000, 10000],
        help="tensor counts of the whole state, optimizer moments included (default 16 1000 10000)",
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4], help="ranks (default 1 2 4)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--json",
        metavar="OUT",
        nargs="?",
        const="-",
        help="write raw timings and the summary as JSON to OUT, or to stdout without OUT "
        "(the table then goes to stderr)",
    )
    parser.add_argument("--dir", help="scratch directory (default: the system temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch of ranks")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="also time raw DCP with the garbage collector paused and ckptlib with it running",
    )
    args = parser.parse_args(argv)
    args.argv = argv
    started = time.perf_counter()
    results = run(args)
    results["seconds"] = time.perf_counter() - started
    rows = summarize(results)
    extra = ablation_markdown(rows)
    text = markdown(rows) + (f"\n\n{extra}" if extra else "")
    emit(
        text + f"\n\nWall time of the benchmark: {results['seconds']:.0f} s.",
        {"results": results, "summary": rows},
        args.json,
    )
    return 0 if all(r["ok"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
