"""`ckpt plan CKPT --world-size M`: a resharded load's reads, from metadata alone (`ckptlib.offline.plan_load`)."""

from __future__ import annotations

import argparse
import json

from ckptlib.cli.roots import add_step, resolve_arg
from ckptlib.cli.usage import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    TRUSTED_HELP,
    UsageError,
    add_command,
    add_no_progress,
    int_at_least,
    progress_bar,
)

DESCRIPTION = """
Dry run of loading CKPT on M ranks whose state is parallelized as --layout: what each rank
will read, from the checkpoint's manifest and .metadata alone (no tensor byte is read, no
process group is made). It applies the load's own rules: DCP's resharding of the saved chunks
onto each rank's part of every tensor, read-once of items several ranks need (one rank reads
such an item and sends it to the others), in-place reads of just the rows a reshard needs,
verified by the checksum blocks around them, and coalesced ranged reads on object stores.

Per rank: the stored items its load needs and those it reads from storage (for itself and,
read once, for others), the bytes it reads (what the load's LoadResult.storage_bytes_read
reports), the bytes it receives from and sends to other ranks, the files and byte ranges it
touches (--ranges lists them), its read calls and, on an object store, its GET requests, the
bytes of its part of the state, and the peak host memory the load needs on it (that part plus
the largest buffer the reads hold at once). For the whole load: the bytes read against the
bytes it needs and the checkpoint's data, and what every rank reading for itself would read
(the duplication of replicated state that read-once avoids).

Which tensors a layout shards: an optimizer's state names its parameters, and a tensor saved
in several chunks is sharded; buffers, scalar optimizer states and objects are whole on every
rank. --spec REF (a training spec, as ckpt validate takes) gives the exact parameters and the
TP plan the tp and fsdp2+tp layouts need (its model is built on the meta device: no memory).
Per-rank state (ckptlib.RankLocal) is read as its default policy does; --rank-state merge when
it merges on a resize (MergeSamplerProgress). Items of foreign formats (torch.save, v0,
safetensors) are read by each rank for itself: bytes needed count every element some rank
reads once, the checkpoint's data every stored piece once. "exact" is false where a number is
an estimate, or where torch.save/v0 files are read whole instead of memory-mapped (pre-zip
files, object stores): the storage then reads more than the bytes shown.

Exit status: 0 planned (and every rank fits in --host-memory, if given); 1 some rank's peak
host memory exceeds --host-memory; 2 an error (no checkpoint at CKPT, a layout that cannot run
at M ranks, a TP layout without --spec: a CheckpointError such as PlanError, one line on stderr).
"""

LAYOUT_NAMES = ("plain", "ddp", "fsdp2", "hsdp", "tp", "fsdp2+tp", "fsdp1", "fsdp1-flat")


_positive = int_at_least(1, "a positive integer")


def _size(text: str) -> int:
    from ckptlib.format.output import parse_size

    try:
        return parse_size(text)  # type: ignore[return-value]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes or a size like 64GiB, got {text!r}") from None


def add_parser(commands) -> None:
    p = add_command(
        commands,
        "plan",
        help="dry run of a resharded load at M ranks: each rank's reads, bytes, files, requests and peak memory",
        description=DESCRIPTION,
    )
    p.add_argument(
        "checkpoint", metavar="CKPT", help="a checkpoint or a manager root: path, file://, s3://, gs:// or az:// URI"
    )
    add_step(p)
    p.add_argument("--world-size", "-n", type=_positive, required=True, metavar="M", help="ranks of the load")
    p.add_argument(
        "--layout",
        choices=LAYOUT_NAMES,
        default="fsdp2",
        help="how the loading state is parallelized (default fsdp2; hsdp and fsdp2+tp as 2 x M/2)",
    )
    p.add_argument("--spec", metavar="REF", help="a training spec (pkg.module:NAME or file.py:NAME): its model's "
                   "parameters and TP plan (needed by tp and fsdp2+tp)")  # fmt: skip
    p.add_argument(
        "--rank-state",
        choices=["keep", "merge"],
        default="keep",
        help="per-rank state on a resize: keep (a rank restores its own, new ranks start fresh; default) or "
        "merge (every rank reads every saved rank's, as MergeSamplerProgress does)",
    )
    p.add_argument("--only", action="append", metavar="ENTRY", help="plan a load of just this top-level entry "
                   "(repeatable), as load(only=...)")  # fmt: skip
    once = p.add_mutually_exclusive_group()
    once.add_argument(
        "--read-once",
        action="store_true",
        help="read shared items once and exchange them (the default decides by storage)",
    )
    once.add_argument("--no-read-once", action="store_true", help="every rank reads what it needs itself")
    p.add_argument("--no-verify", action="store_true", help="a load with verify=False (no checksum-block reads)")
    p.add_argument("--host-memory", type=_size, metavar="SIZE", help="exit 1 if a rank's peak host memory exceeds "
                   "SIZE (bytes, or like 64GiB)")  # fmt: skip
    p.add_argument("--ranges", action="store_true", help="list each rank's files and byte ranges")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trusted", action="store_true", help=TRUSTED_HELP)
    add_no_progress(p)
    p.set_defaults(func=run, error_exit=EXIT_USAGE)


def spec_model_facts(ref: str, layout: str) -> tuple[set[str], dict | None]:
    """(the parameter FQNs of a spec's model, {parameter: TP shard dim} for TP layouts), the
    model built on the meta device."""
    import torch

    from ckptlib.offline.plan_layouts import tp_dims
    from ckptlib.testing.matrices.training_spec import call_user, load_spec, resolve_reference

    spec = load_spec(resolve_reference(ref))
    with torch.device("meta"):
        model = call_user(spec.build_model, "build_model(0) on the meta device", 0, rank=None)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if layout not in ("tp", "fsdp2+tp"):
        return params, None
    if spec.tp_plan is not None:
        plan = call_user(spec.tp_plan, "tp_plan(model)", model, rank=None)
    elif callable(getattr(model, "tp_plan", None)):
        plan = model.tp_plan()
    else:
        raise UsageError(f"--layout {layout}: spec {ref} has no tp_plan (and its model no tp_plan() method)")
    return params, tp_dims(model, plan)


def render(report, ranges: bool = False) -> str:
    from ckptlib.cli.listing import human_bytes as hb

    src = [report.format]
    if report.step is not None:
        src.append(f"step {report.step}")
    if report.saved_world_size is not None:
        src.append(f"saved by {report.saved_world_size} rank{'s' if report.saved_world_size != 1 else ''}")
    once = "read once" if report.read_once else "each rank reads for itself"
    lines = [
        f"ckpt plan: {report.uri} ({', '.join(src)}) -> {report.world_size} ranks as {report.layout}, "
        f"{report.storage} storage, {once}"
    ]
    store = report.storage != "local"
    head = ["rank", "items", "read", "received", "sent", "files", "reads"] + (["GETs"] if store else [])
    head += ["state", "peak host"]
    rows = [head]
    for r in report.ranks:
        row = [str(r.rank), f"{r.items}/{r.items_needed}", hb(r.bytes_read), hb(r.bytes_received), hb(r.bytes_sent)]
        row += [str(len(r.files)), str(r.reads)] + ([str(r.requests)] if store else [])
        rows.append(row + [hb(r.state_bytes), hb(r.peak_host_bytes)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if ranges:
        for r in report.ranks:
            for f in r.files:
                spans = ", ".join(f"{a}-{b}" for a, b in f["ranges"][:8]) + (" ..." if len(f["ranges"]) > 8 else "")
                lines.append(f"rank {r.rank} {f['file']}: {hb(f['bytes'])} in {f['reads']} reads: {spans}")
    doc = report.to_json()
    lines.append(
        f"whole load: reads {hb(report.bytes_read)} ({doc['read_amplification']:.2f}x the {hb(report.bytes_needed)} "
        f"it needs) of a checkpoint of {hb(report.checkpoint_bytes)}; every rank reading for itself would read "
        f"{hb(report.bytes_read_each_for_itself)} ({doc['amplification_each_for_itself']:.2f}x); peak host memory "
        f"{hb(doc['peak_host_bytes'])} on one rank"
    )
    if not report.exact and report.format in ("torch_save", "v0"):
        lines.append(
            f"note: {report.format} files are read whole into memory here (not memory-mapped): the storage reads "
            "more than the bytes read shown (the pieces each rank copies)"
        )
    elif not report.exact:
        lines.append("note: some item layouts could not be computed here; their reads are estimates")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ckptlib.offline.plan_load import plan_load

    args.checkpoint = resolve_arg(args, args.checkpoint).uri
    params = tp = None
    if args.spec:
        from ckptlib.testing.matrices.training_spec import SpecError

        try:
            params, tp = spec_model_facts(args.spec, args.layout)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
    with progress_bar(args, "ckpt plan", total=args.world_size, unit="rank") as bar:
        report = plan_load(
            args.checkpoint,
            args.world_size,
            args.layout,
            params=params,
            tp_dims=tp,
            rank_state=args.rank_state,
            only=args.only,
            read_once=True if args.read_once else False if args.no_read_once else "auto",
            verify=not args.no_verify,
            trusted=args.trusted,
            on_rank=lambda: bar.update(1),
        )
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(render(report, args.ranges))
    over = [r.rank for r in report.ranks if args.host_memory is not None and r.peak_host_bytes > args.host_memory]
    if over:
        import sys

        print(f"ckpt plan: ranks {over} need more than --host-memory {args.host_memory} bytes", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK
