"""Coordinator-side cost of a checkpoint at simulated scale, without spawning ranks.

For each (world size, tensor count) it runs, in a forked child, the coordinator's side of two
saves of a transformer-shaped state row-sharded over every rank, through ckptlib's own code
(`ckptlib.bench.scale_cell`): the ranks' plans and write results arrive pickled as DCP's
gathers carry them; the first save plans (`CkptSavePlanner`, and in the same cell DCP's
`DefaultSavePlanner` for comparison), writes `.metadata` and the manifest; the second save of
the unchanged state reuses the first one's plans (`format.plan_cache`): its coordinator
planning against the first's is the "second / first" column. Memory: the child's peak RSS
over its start during the first save (and per chunk), the Python objects alive at its peak
(tracemalloc) and what the plan cache keeps between saves. Then rank 0's open for a load
(`open_checkpoint`: manifest, `.metadata` checked and unpickled, structure check; plus
pickling what it broadcasts), per chunk, and one rank's load plan.

With --s3 it also counts the S3 requests (LIST, HEAD, GET, PUT, multipart) of a real
`ckptlib.save` and `ckptlib.load` of a small state at 1, 2 and 4 ranks against a moto
server, and prints them next to the formula (`ckptlib.bench.s3_requests`) for every world size.

With --ranks 2,4,8,16 it measures real ranks instead (`ckptlib.bench.scale_ranks`): per
operation (save, load, async save, each twice) and rank, ckptlib against plain DCP in the same
launch of gloo ranks, the collectives, payload bytes sent and received, process groups
created, store operations, sockets and threads, of a 12-layer transformer-shaped state with
its optimizer state (DTensors); the table, then the fitted growth of each figure with the
ranks (the exponent b of count = a * ranks**b).

Run: ckpt bench scale [--worlds 8,64,512,4096] [--tensors 1000,10000,100000]
                      [--max-chunks N] [--dcp-max-chunks N] [--traced-max-chunks N] [--s3] [--json]
                      [--from-json IN] [--plot OUT.png] [--markdown OUT.md] [--load-plan-only]
     ckpt bench scale --ranks 2,4,8,16 [--layers 12] [--hidden 64] [--json] [--markdown OUT.md]

Cells with more than --max-chunks chunks (world x tensors) are skipped (reported as such);
DCP's planner is timed only up to --dcp-max-chunks (its overlap check is quadratic in the
world size for wide tensors), the tracemalloc pass only up to --traced-max-chunks. Every row
also has the child's peak resident memory over the whole cell (`process_peak_mib`: the
ranks' simulated payloads, both saves, rank 0's open and one rank's load plan). With
--load-plan-only a cell is only one rank's load plan, through ckptlib and DCP, on the cell's
`.metadata` built in memory (no save: cells far larger than a whole save fits).

Prints one line per cell as it is measured (key=value pairs, or one JSON object with --json);
--markdown and --plot write the grid as a table and as log-log curves.
Exit status: 0 (a cell that could not be measured says why in its row), 1 when a real-rank
load did not return exactly the values saved, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys

from ckptlib.bench import counted, help_description


def _child(conn, world: int, tensors: int, dcp_max_chunks: int, traced_max_chunks: int) -> None:
    from ckptlib.bench.scale_cell import measure_cell, measure_load_plan  # torch: not needed for --help

    try:
        if traced_max_chunks < 0:  # --load-plan-only
            conn.send(measure_load_plan(world, tensors))
        else:
            conn.send(measure_cell(world, tensors, dcp_max_chunks, traced_max_chunks))
    except BaseException as exc:  # reported in the row, the grid goes on
        conn.send({"world": world, "tensors": tensors, "error": f"{type(exc).__name__}: {exc}"})


def measure(world: int, tensors: int, dcp_max_chunks: int = 0, traced_max_chunks: int = 300_000) -> dict:
    """One cell, in a forked child (its peak RSS is the cell's alone; memory is freed after)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, world, tensors, dcp_max_chunks, traced_max_chunks))
    proc.start()
    child.close()
    try:
        row = parent.recv()
    except EOFError:
        row = {"world": world, "tensors": tensors, "error": "the measuring process died (out of memory?)"}
    proc.join()
    return row


PANELS = (  # (title, y label, [(key, label)], whether the quantity grows with the chunks)
    (
        "coordinator: save planning",
        "seconds",
        [
            ("coordinator_plan_s", "first save: plan + .metadata + manifest"),
            ("global_plan_ckptlib_s", "first save: global plan, CkptSavePlanner"),
            ("global_plan_dcp_s", "global plan, DCP DefaultSavePlanner"),
            ("coordinator_plan_cached_s", "second save (plans reused): plan + records"),
        ],
        True,
    ),
    (
        "coordinator: memory of a save, per chunk",
        "bytes",
        [
            ("bytes_per_chunk", "peak RSS over start"),
            ("traced_bytes_per_chunk", "Python objects at the peak (tracemalloc)"),
            ("cached_bytes_per_chunk", "kept by the plan cache between saves"),
        ],
        False,
    ),
    (
        "second save's coordinator planning / first's",
        "ratio",
        [("second_over_first", "plans reused / planned")],
        False,
    ),
    (
        "checkpoint records",
        "bytes",
        [("metadata_bytes", ".metadata (pickle)"), ("manifest_bytes", "ckptlib.json")],
        True,
    ),
    (
        "load",
        "seconds",
        [
            ("coordinator_open_s", "rank 0: open (parse + check + broadcast pickle)"),
            ("rank_metadata_unpickle_s", "one rank: unpickle the metadata"),
            ("rank_load_plan_s", "one rank: its load plan (ckptlib)"),
            ("rank_load_plan_dcp_s", "one rank: its load plan (DCP's function)"),
        ],
        True,
    ),
    ("rank 0's open for a load, per chunk", "microseconds", [("open_us_per_chunk", "open + broadcast pickle")], False),
)


def plot(rows: list[dict], path: str) -> None:
    """Log-log curves of every measured quantity against chunks (world x tensors), one line and
    marker per world size; a dotted O(chunks) line through the smallest point of quantities
    that grow with the chunks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in rows if "metadata_bytes" in r), key=lambda r: r["chunks"])
    worlds = sorted({r["world"] for r in rows})
    markers = dict(zip(worlds, "osD^v<>p*h"))
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    for ax, (title, ylabel, series, grows) in zip(axes.flat, PANELS):
        for (key, label), color in zip(series, ("C0", "C1", "C3", "C2")):
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
            if grows:
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
    shapes = ", ".join(f"{m} {counted(w, 'rank')}" for w, m in markers.items())
    fig.suptitle(f"ckpt bench scale: markers {shapes}; dotted: O(chunks) from the first point", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def _g(row: dict, key: str, fmt: str = ".3g") -> str:
    value = row.get(key)
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict]) -> list[str]:
    """The grid as a markdown table (skipped cells say so; "-": not measured by that run)."""
    out = [
        "| world | tensors | chunks | coordinator plan s: first / second save | second / first "
        "| global plan s: ckptlib / DCP | peak MiB | bytes per chunk: RSS / objects / cached "
        "| .metadata MB | manifest MB | rank 0 open s | open us per chunk "
        "| one rank: unpickle s / load plan s: ckptlib / DCP | cell's peak MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plans_only = [r for r in rows if "chunks" in r and "metadata_bytes" not in r]
    rows = [r for r in rows if r not in plans_only]
    for r in rows:
        if "chunks" not in r:
            why = r.get("skipped") or r.get("error")
            out.append(f"| {r['world']} | {r['tensors']:,} | {r['world'] * r['tensors']:,} | {why} |||||||||||")
            continue
        dcp = "not run" if r.get("global_plan_dcp_s") is None else f"{r['global_plan_dcp_s']:.3g}"
        out.append(
            f"| {r['world']} | {r['tensors']:,} | {r['chunks']:,} "
            f"| {_g(r, 'coordinator_plan_s')} / {_g(r, 'coordinator_plan_cached_s')} | {_g(r, 'second_over_first')} "
            f"| {_g(r, 'global_plan_ckptlib_s')} / {dcp} | {_g(r, 'coordinator_peak_mib', '.0f')} "
            f"| {_g(r, 'bytes_per_chunk', ',')} / {_g(r, 'traced_bytes_per_chunk', ',')} "
            f"/ {_g(r, 'cached_bytes_per_chunk', ',')} "
            f"| {r['metadata_bytes'] / 1e6:.3g} | {r['manifest_bytes'] / 1e6:.3g} "
            f"| {_g(r, 'coordinator_open_s')} | {_g(r, 'open_us_per_chunk')} "
            f"| {_g(r, 'rank_metadata_unpickle_s')} / {_g(r, 'rank_load_plan_s')} / {_g(r, 'rank_load_plan_dcp_s')} "
            f"| {_g(r, 'process_peak_mib', '.0f')} |"
        )
    if plans_only:  # --load-plan-only cells
        out += ["", "| world | tensors | chunks | one rank's load plan s: ckptlib / DCP | reads | peak MiB |"]
        out.append("|---:|---:|---:|---:|---:|---:|")
        for r in plans_only:
            out.append(
                f"| {r['world']} | {r['tensors']:,} | {r['chunks']:,} | {_g(r, 'rank_load_plan_s')} "
                f"/ {_g(r, 'rank_load_plan_dcp_s')} | {r['rank_reads']} | {_g(r, 'process_peak_mib', '.0f')} |"
            )
    return out


def _counts(text: str) -> list[int]:
    """A comma-separated list of positive integers (`--worlds`, `--tensors`)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _real_ranks(args: argparse.Namespace) -> int:
    """`--ranks`: one launch per world size; the table (stderr with --json, whose lines are
    one object per world size, then one with the fitted growth) and the growth."""
    from ckptlib.bench import scale_ranks

    results = []
    out = sys.stderr if args.json else sys.stdout
    for world in args.ranks:
        print(f"[bench scale] {counted(world, 'rank')}", file=sys.stderr, flush=True)
        result = scale_ranks.measure(world, args.layers, args.hidden, args.timeout)
        results.append(result)
        if args.json:
            print(json.dumps(result), flush=True)
    table = scale_ranks.markdown(results)
    fits = scale_ranks.growth(results)
    print(table, file=out)
    print("\ngrowth with the ranks (b of count = a * ranks**b; max over ranks):", file=out)
    for fit in fits:
        print("  " + "  ".join(f"{k}={v}" for k, v in fit.items()), file=out)
    if args.json:
        print(json.dumps({"growth": fits}), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0 if all(r["ok"] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ckpt bench scale",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--worlds", type=_counts, default="8,64,512,4096", help="comma-separated world sizes (default 8,64,512,4096)"
    )
    parser.add_argument(
        "--tensors",
        type=_counts,
        default="1000,10000,100000",
        help="comma-separated tensor counts (default 1000,10000,100000)",
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
        "--traced-max-chunks",
        type=int,
        default=300_000,
        help="the tracemalloc pass (Python objects at the peak, a third save) only up to this many chunks",
    )
    parser.add_argument(
        "--load-plan-only",
        action="store_true",
        help="per cell only one rank's load plan (ckptlib's and DCP's) on metadata built in memory, no save",
    )
    parser.add_argument(
        "--s3",
        action="store_true",
        help="also count S3 requests of real saves/loads at 1, 2, 4 ranks (moto) and print the formula",
    )
    parser.add_argument(
        "--ranks",
        type=_counts,
        help="real gloo ranks instead of the simulated grid: count each operation's collectives, bytes, "
        "groups, store operations and sockets per rank, ckptlib against DCP (e.g. 2,4,8,16)",
    )
    parser.add_argument("--layers", type=int, default=12, help="--ranks: transformer layers of the state (default 12)")
    parser.add_argument("--hidden", type=int, default=64, help="--ranks: width of the state (default 64)")
    parser.add_argument("--timeout", type=float, default=900.0, help="--ranks: seconds per launch of ranks")
    parser.add_argument("--json", action="store_true", help="one JSON object per line on stdout")
    parser.add_argument("--from-json", metavar="IN", help="no measuring: read the rows of an earlier --json run")
    parser.add_argument("--plot", metavar="OUT.png", help="write the curves as a PNG (needs matplotlib)")
    parser.add_argument("--markdown", metavar="OUT.md", help="write the grid as a markdown table")
    args = parser.parse_args(argv)
    if args.ranks:
        return _real_ranks(args)
    worlds = args.worlds
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    if args.from_json:
        with open(args.from_json) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        for world in worlds:
            for tensors in args.tensors:
                if world * tensors > args.max_chunks:
                    emit({"world": world, "tensors": tensors, "skipped": f"{world * tensors:,} chunks > --max-chunks"})
                else:
                    emit(
                        measure(
                            world, tensors, args.dcp_max_chunks, -1 if args.load_plan_only else args.traced_max_chunks
                        )
                    )
        if args.s3:
            from ckptlib.bench import s3_requests

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
