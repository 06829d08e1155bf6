"""Coordinator-side cost of a checkpoint at simulated scale, without spawning ranks.

For each (world size, tensor count) it builds what the save and load of a transformer-shaped
state row-sharded over every rank would build: each rank's SavePlan (one chunk per tensor;
half the tensors are "wide", more columns than rows like an MLP down-projection, half
"tall"), the global save plan and Metadata with ckptlib's planner (`CkptSavePlanner`, what
`ckptlib.save` runs) and, side by side, with DCP's `DefaultSavePlanner`; the pickled
`.metadata` with one storage record per chunk; ckptlib's manifest (a FileRecord per shard
file, one item record per chunk); what rank 0 does to open the checkpoint for a load
(parse the manifest, safely unpickle `.metadata`, check its structure); and one rank's load
plan (DCP's resharding reads for its chunk of every tensor). Every cell runs in a forked
child, whose peak RSS over its starting RSS is the coordinator's memory.

With --s3 it also counts the S3 requests (LIST, HEAD, GET, PUT, multipart) of a real
`ckptlib.save` and `ckptlib.load` of a small state at 1, 2 and 4 ranks against a moto
server, and prints them next to the formula (`ckptlib.bench.s3_requests`) for every world size.

Run: ckpt bench scale [--worlds 8,64,512,4096] [--tensors 1000,10000,100000]
                      [--max-chunks N] [--dcp-max-chunks N] [--s3] [--json]
                      [--from-json IN] [--plot OUT.png] [--markdown OUT.md]

Cells with more than --max-chunks chunks (world x tensors) are skipped (reported as such);
DCP's planner is timed only up to --dcp-max-chunks (its overlap check is quadratic in the
world size for wide tensors).

Prints one line per cell as it is measured (key=value pairs, or one JSON object with --json);
--markdown and --plot write the grid as a table and as log-log curves.
Exit status: 0 (a cell that could not be measured says why in its row), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import resource
import sys
import time

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .._torch import dcp_shims
from ..format.manifest import FileRecord, Manifest
from ..format.safe_pickle import safe_loads
from ..format.save_planner import CkptSavePlanner
from ..format.structure import structure_problems
from . import help_description

ROWS_PER_RANK, TALL_COLS = 4, 64  # tall tensors: (world * 4, 64); wide ones: (world * 4, world * 16)


def _tensor_names(count: int) -> list[str]:
    return [f"model.layers.{i // 16}.param{i % 16}.weight" for i in range(count)]


def _cols(world: int, index: int) -> int:
    return world * ROWS_PER_RANK * 4 if index % 2 else TALL_COLS


def _chunk(rank: int, cols: int) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size([rank * ROWS_PER_RANK, 0]), sizes=torch.Size([ROWS_PER_RANK, cols]))


def _save_plans(world: int, names: list[str]) -> list[SavePlan]:
    props = TensorProperties(dtype=torch.float32)
    sizes = [torch.Size([world * ROWS_PER_RANK, _cols(world, i)]) for i in range(len(names))]
    plans = []
    for rank in range(world):
        items = []
        for i, name in enumerate(names):
            chunk = _chunk(rank, sizes[i][1])
            items.append(
                WriteItem(
                    index=MetadataIndex(name, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=sizes[i]),
                )
            )
        plans.append(SavePlan(items, planner_data={name: (name,) for name in names}))
    return plans


def _plan_and_write_records(world: int, names: list[str]) -> tuple[bytes, bytes, float]:
    """Global planning on the coordinator (ckptlib's planner), then the `.metadata` and
    manifest bytes it writes; also the seconds of the global-plan step alone."""
    plans = _save_plans(world, names)
    start = time.perf_counter()
    global_plans, metadata = CkptSavePlanner().create_global_plan(plans)
    global_plan_s = time.perf_counter() - start
    del plans
    storage_info = dcp_shims.storage_info_cls()
    storage_data = {}
    files = {}
    for rank, plan in enumerate(global_plans):
        name = f"__{rank}_0.distcp"
        items = []
        offset = 0
        for item in plan.items:
            length = (
                800 + ROWS_PER_RANK * item.tensor_data.chunk.sizes[1] * 4
            )  # a torch.save archive of the chunk, roughly
            storage_data[item.index] = storage_info(name, offset, length)
            items.append((offset, length, (rank * 7919 + offset) & 0xFFFFFFFF))
            offset += length
        blocks = [(rank + b) & 0xFFFFFFFF for b in range(-(-offset // (1 << 20)))]
        files[name] = FileRecord(size=offset, crc32=rank, items=items, block_size=1 << 20, blocks=blocks)
    metadata.storage_data = storage_data
    return pickle.dumps(metadata), Manifest(world_size=world, files=files).to_bytes(), global_plan_s


def _open_for_load(metadata_blob: bytes, manifest_blob: bytes) -> int:
    """What rank 0 does with the two files before a load (I/O and checksums aside): parse the
    manifest, safely unpickle `.metadata`, check its structure. Returns the problem count."""
    manifest = Manifest.from_bytes(manifest_blob, "scale/ckptlib.json")
    metadata = safe_loads(metadata_blob, "scale/.metadata")
    return len(structure_problems(metadata, manifest, {}, exhaustive=False))


def _load_plan(metadata_blob: bytes, names: list[str], rank: int) -> int:
    """One rank's reads for its chunk of every tensor (DCP's resharding path); returns the count."""
    metadata = pickle.loads(metadata_blob)
    world = len(metadata.state_dict_metadata[names[0]].chunks)
    return sum(
        len(create_read_items_for_chunk_list(name, metadata.state_dict_metadata[name], [_chunk(rank, _cols(world, i))]))
        for i, name in enumerate(names)
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _measure_here(world: int, tensors: int, dcp_max_chunks: int) -> dict:
    names = _tensor_names(tensors)
    rss_before = _rss_bytes()
    (metadata_blob, manifest_blob, global_plan_s), plan_s = _timed(_plan_and_write_records, world, names)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    plans_s = {"ckptlib": global_plan_s}
    if world * tensors <= dcp_max_chunks:
        dcp_plans = _save_plans(world, names)
        plans_s["dcp"] = _timed(DefaultSavePlanner().create_global_plan, dcp_plans)[1]
        del dcp_plans
    problems, open_s = _timed(_open_for_load, metadata_blob, manifest_blob)
    assert problems == 0, f"{problems} structure problems in the simulated checkpoint"
    reads, load_plan_s = _timed(_load_plan, metadata_blob, names, world - 1)
    return {
        "world": world,
        "tensors": tensors,
        "chunks": world * tensors,
        "coordinator_plan_s": round(plan_s, 4),
        "coordinator_peak_mib": round(peak / 2**20, 1),
        "global_plan_ckptlib_s": round(plans_s["ckptlib"], 4),
        "global_plan_dcp_s": round(plans_s["dcp"], 4) if "dcp" in plans_s else None,
        "metadata_bytes": len(metadata_blob),
        "manifest_bytes": len(manifest_blob),
        "coordinator_open_s": round(open_s, 4),
        "rank_load_plan_s": round(load_plan_s, 4),
        "rank_reads": reads,
    }


def _child(conn, world: int, tensors: int, dcp_max_chunks: int) -> None:
    try:
        conn.send(_measure_here(world, tensors, dcp_max_chunks))
    except BaseException as exc:  # reported in the row, the grid goes on
        conn.send({"world": world, "tensors": tensors, "error": f"{type(exc).__name__}: {exc}"})


def measure(world: int, tensors: int, dcp_max_chunks: int = 0) -> dict:
    """One cell, in a forked child (its peak RSS is the cell's alone; memory is freed after)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, world, tensors, dcp_max_chunks))
    proc.start()
    child.close()
    try:
        row = parent.recv()
    except EOFError:
        row = {"world": world, "tensors": tensors, "error": "the measuring process died (out of memory?)"}
    proc.join()
    return row


PANELS = (  # (title, y label, [(key, label)])
    (
        "coordinator: save planning",
        "seconds",
        [
            ("coordinator_plan_s", "plan + .metadata + manifest (ckptlib)"),
            ("global_plan_ckptlib_s", "global plan, CkptSavePlanner"),
            ("global_plan_dcp_s", "global plan, DCP DefaultSavePlanner"),
        ],
    ),
    ("coordinator: peak memory of the save", "MiB", [("coordinator_peak_mib", "peak RSS over start")]),
    ("checkpoint records", "bytes", [("metadata_bytes", ".metadata (pickle)"), ("manifest_bytes", "ckptlib.json")]),
    (
        "load",
        "seconds",
        [
            ("coordinator_open_s", "rank 0: parse + check both records"),
            ("rank_load_plan_s", "one rank: its load plan"),
        ],
    ),
)


def plot(rows: list[dict], path: str) -> None:
    """Log-log curves of every measured quantity against chunks (world x tensors), one
    line and marker per world size, and a dotted O(chunks) line through the smallest point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if "chunks" in r), key=lambda r: r["chunks"])
    worlds = sorted({r["world"] for r in rows})
    markers = dict(zip(worlds, "osD^v<>p*h"))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (title, ylabel, series) in zip(axes.flat, PANELS):
        for (key, label), color in zip(series, ("C0", "C1", "C3")):
            points = [(r["chunks"], r[key], r["world"]) for r in rows if r.get(key)]
            if not points:
                continue
            for world in worlds:
                mine = [p for p in points if p[2] == world]
                ax.plot(
                    [p[0] for p in mine],
                    [p[1] for p in mine],
                    "-" + markers[world],
                    color=color,
                    ms=5,
                    lw=0.8,
                    label=label if world == worlds[0] else None,
                )
            x0, y0 = points[0][0], points[0][1]
            xs = [x0, rows[-1]["chunks"]]
            ax.plot(xs, [y0, y0 * xs[1] / x0], ":", color=color, lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("chunks = world size x tensors")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    shapes = ", ".join(f"{m} {w} ranks" for w, m in markers.items())
    fig.suptitle(f"ckpt bench scale: markers {shapes}; dotted: O(chunks) from the first point", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def markdown(rows: list[dict]) -> list[str]:
    """The grid as a markdown table (skipped cells say so)."""
    out = [
        "| world | tensors | chunks | coordinator plan s | global plan s: ckptlib / DCP | peak MiB "
        "| .metadata MB | manifest MB | rank 0 open s | one rank's load plan s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "chunks" not in r:
            why = r.get("skipped") or r.get("error")
            out.append(f"| {r['world']} | {r['tensors']:,} | {r['world'] * r['tensors']:,} | {why} |||||||")
            continue
        dcp = "not run" if r["global_plan_dcp_s"] is None else f"{r['global_plan_dcp_s']:.3g}"
        out.append(
            f"| {r['world']} | {r['tensors']:,} | {r['chunks']:,} | {r['coordinator_plan_s']:.3g} "
            f"| {r['global_plan_ckptlib_s']:.3g} / {dcp} | {r['coordinator_peak_mib']:.0f} "
            f"| {r['metadata_bytes'] / 1e6:.3g} | {r['manifest_bytes'] / 1e6:.3g} "
            f"| {r['coordinator_open_s']:.3g} | {r['rank_load_plan_s']:.3g} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ckpt bench scale",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worlds", default="8,64,512,4096", help="comma-separated world sizes (default 8,64,512,4096)")
    parser.add_argument(
        "--tensors", default="1000,10000,100000", help="comma-separated tensor counts (default 1000,10000,100000)"
    )
    parser.add_argument(
        "--max-chunks", type=int, default=2_000_000, help="skip cells with more chunks (world x tensors)"
    )
    parser.add_argument(
        "--dcp-max-chunks",
        type=int,
        default=300_000,
        help="time DCP's own DefaultSavePlanner only up to this many chunks",
    )
    parser.add_argument(
        "--s3",
        action="store_true",
        help="also count S3 requests of real saves/loads at 1, 2, 4 ranks (moto) and print the formula",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    parser.add_argument("--from-json", metavar="IN", help="no measuring: read the rows of an earlier --json run")
    parser.add_argument("--plot", metavar="OUT.png", help="write the curves as a PNG (needs matplotlib)")
    parser.add_argument("--markdown", metavar="OUT.md", help="write the grid as a markdown table")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    if args.from_json:
        with open(args.from_json) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        for world in worlds:
            for tensors in (int(t) for t in args.tensors.split(",")):
                if world * tensors > args.max_chunks:
                    emit({"world": world, "tensors": tensors, "skipped": f"{world * tensors:,} chunks > --max-chunks"})
                else:
                    emit(measure(world, tensors, args.dcp_max_chunks))
        if args.s3:
            from . import s3_requests

            for row in s3_requests.rows(worlds):
                emit(row)
    grid = [r for r in rows if "s3" not in r]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(markdown(grid)) + "\n")
    if args.plot:
        plot(grid, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
