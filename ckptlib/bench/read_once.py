"""Read once: the bytes a load reads from storage, summed over its ranks, and its time, with
read-once (each replicated item read by one rank and sent to the others over the process
group), without (`read_once=False`: every rank reads what it needs itself, as plain DCP
does) and by default (`read_once="auto"`: the load decides by the storage), side by side in
one run.

Layouts: "ddp" (the whole state on every rank: plain tensors, as DDP's state dict) and "hsdp"
(DTensors on a 2-D (replicate 2, shard world/2) mesh, Replicate() x Shard(0)). The state is
`--size-mib` MiB of float32 in 16 tensors (the full size; HSDP ranks hold half of it each), plus
a small object (param_groups-like) every rank loads. It is saved once per layout (to `--root`,
which may be an s3:// or other object-store URI; default a temporary directory), then loaded
with and without read-once in a rotating order, `--reps` times, each load into a zeroed
template and checked bit-exact. Local loads are from the page cache (the files are read
once before each timed load).

Run: ckpt bench read-once [--layouts ddp hsdp] [--world 4] [--size-mib 64] [--reps 3]
                          [--root URI] [--json [OUT]] [--quick]

Every time is the slowest rank's (barriers around the load), median over the repetitions;
"storage MiB" is `sum(LoadResult.storage_bytes_read_by_rank)`, "x needed" that over
`LoadResult.bytes_needed` (the distinct stored items the load reads); "decided" is
`LoadResult.read_once`. Targets: read-once's sum <= 1.1x needed (issue 25.1); the default
reads about once from an object store (<= 1.1x needed) and takes at most 1.15x the time of
every rank reading for itself from a local disk (issue 35.1).

Exit status: 0 when every load was bit-exact, 1 when one was not, 2 usage error.
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
from ckptlib.bench.rank_ops import MiB, barrier, rank_world, timed, warm

TENSORS = 16
COLS = 1024
TARGET = 1.1
DEFAULT_TARGET = 1.15  # the default's time over every-rank's, on a local disk
METHODS = ("default", "read-once", "every-rank")
SETTING = {"default": "auto", "read-once": True, "every-rank": False}


def make_state(layout: str, size_mib: int, fill: bool) -> dict[str, Any]:
    """{"params": {t0..t15}, "groups": [...]}: plain full tensors ("ddp") or DTensors
    Replicate() x Shard(0) on a (2, world/2) mesh ("hsdp"), `size_mib` MiB in all."""
    import torch

    rank, world = rank_world()
    rows = max(world, (size_mib * MiB) // (TENSORS * COLS * 4))
    rows -= rows % world
    params: dict[str, Any] = {}
    mesh = None
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for i in range(TENSORS):
        full = torch.zeros(rows, COLS)
        if fill:
            full.uniform_(generator=torch.Generator().manual_seed(1000 + i))
        if mesh is None:
            params[f"t{i}"] = full
        else:
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            params[f"t{i}"] = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    groups = [{"lr": 0.001 if fill else 0.0, "betas": (0.9, 0.95), "params": list(range(TENSORS))}]
    return {"params": params, "groups": groups}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a["groups"] == b["groups"] and all(
        torch.equal(_local(a["params"][k]), _local(b["params"][k])) for k in a["params"]
    )


def rank_read_once(uri: str, layout: str, size_mib: int, reps: int, local: bool) -> dict[str, Any]:
    """Save once, then load with and without read-once, `reps` times each, alternating."""
    import torch

    import ckptlib

    rank, _ = rank_world()
    state = make_state(layout, size_mib, fill=True)
    ckptlib.save(uri, state)
    template = make_state(layout, size_mib, fill=False)
    ckptlib.load(uri, template)  # untimed: the first load of a group creates its exchange group
    out: dict[str, Any] = {"rank": rank, "ok": True}
    for rep in range(reps):
        order = METHODS if rep % 2 == 0 else METHODS[::-1]
        for method in order:
            with torch.no_grad():
                for t in template["params"].values():
                    _local(t).zero_()
            template["groups"] = make_state(layout, 0, fill=False)["groups"]
            if local:
                warm(uri)
            results: list[Any] = []
            seconds = timed(lambda: results.append(ckptlib.load(uri, template, read_once=SETTING[method])))
            result = results[0]
            row = out.setdefault(method, {"seconds": [], "storage": [], "received": [], "needed": 0, "decided": []})
            row["seconds"].append(seconds)
            row["storage"].append(sum(result.storage_bytes_read_by_rank))
            row["received"].append(result.bytes_received)
            row["needed"] = result.bytes_needed
            row["decided"].append(result.read_once)
            out["ok"] = out["ok"] and _same(state, template)
    barrier()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ckptlib.testing import launch

    scratch = None
    if args.root is None:
        scratch = tempfile.mkdtemp(prefix="ckptlib-bench-read-once-", dir=args.dir)
        args.root = scratch
    results: dict[str, Any] = {
        "command": "ckpt bench read-once " + " ".join(args.argv),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "load_average_at_start": os.getloadavg()},
        "rows": [],
    }
    local = "://" not in args.root or args.root.startswith("file://")
    try:
        for layout in args.layouts:
            uri = f"{args.root.rstrip('/')}/{layout}-w{args.world}"
            print(
                f"[bench read-once {time.strftime('%H:%M:%S')}] {layout} at {counted(args.world, 'rank')}",
                file=sys.stderr,
            )
            out = launch(args.world, rank_read_once, uri, layout, args.size_mib, args.reps, local, timeout=args.timeout)
            row: dict[str, Any] = {
                "layout": layout,
                "world": args.world,
                "local": local,
                "ok": all(r["ok"] for r in out),
            }
            for method in METHODS:
                per_rep = [max(r[method]["seconds"][i] for r in out) for i in range(args.reps)]
                row[method] = {
                    "seconds": statistics.median(per_rep),
                    "storage": statistics.median(out[0][method]["storage"]),
                    "received": sum(statistics.median(r[method]["received"]) for r in out),
                    "needed": out[0][method]["needed"],
                    "read_once": all(all(r[method]["decided"]) for r in out),
                }
            results["rows"].append(row)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "| layout | ranks | method | read once | load s | storage MiB (all ranks) | x needed "
        "| received MiB (all ranks) | target | bit-exact |",
        "|---|---:|---|---|---:|---:|---:|---:|---|---|",
    ]
    for row in results["rows"]:
        for method in METHODS:
            r = row[method]
            ratio = r["storage"] / r["needed"] if r["needed"] else float("nan")
            lines.append(
                f"| {row['layout']} | {row['world']} | {method} | {'yes' if r['read_once'] else 'no'} "
                f"| {r['seconds']:.3f} | {r['storage'] / MiB:.1f} | {ratio:.2f} | {r['received'] / MiB:.1f} "
                f"| {_target(row, method, ratio)} | {'yes' if row['ok'] else 'NO'} |"
            )
    return "\n".join(lines)


def _target(row: dict[str, Any], method: str, ratio: float) -> str:
    """The row's target: read-once's bytes; the default's time on a local disk (against every
    rank reading for itself, same run), its bytes on an object store."""
    if method == "read-once" or (method == "default" and not row.get("local", True)):
        return ("met" if ratio <= TARGET else "missed") + f" (≤ {TARGET}x needed)"
    if method == "default":
        slower = row[method]["seconds"] / row["every-rank"]["seconds"] if row["every-rank"]["seconds"] else 0.0
        return (
            "met" if slower <= DEFAULT_TARGET else "missed"
        ) + f" ({slower:.2f}x every-rank's time ≤ {DEFAULT_TARGET})"
    return "-"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ckpt bench read-once",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layouts", nargs="+", choices=("ddp", "hsdp"), default=["ddp", "hsdp"])
    parser.add_argument("--world", type=int, default=4, help="ranks (default 4; hsdp needs an even number >= 4)")
    parser.add_argument("--size-mib", type=int, default=64, help="state size in MiB (default 64)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--root", help="where to save (a path or an object-store URI; default a temp dir)")
    parser.add_argument("--dir", help="scratch directory for the default root (default: the system temp dir)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch of ranks")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 MiB, 1 repetition")
    parser.add_argument("--json", metavar="OUT", nargs="?", const="-", help="the report as JSON to OUT (or stdout)")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.size_mib, args.reps = 1, 1
    if "hsdp" in args.layouts and (args.world < 4 or args.world % 2):
        parser.error("hsdp needs an even --world of at least 4")
    results = run(args)
    emit(markdown(results), results, args.json)
    return 0 if all(r["ok"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
