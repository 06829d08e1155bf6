"""The `ckpt` command: validate a cluster/storage pair, check and describe checkpoints, and
operate on checkpoint roots.

Exit codes: 0 success, 1 a check failed (validation failure, damaged checkpoint, a locked
root, a storage error), 2 usage errors or a path that is not what the command needs (no
checkpoint there). User errors print one line, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Iterator, Sequence

from .listing import age_seconds, human_age, human_bytes, metric_text

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
_NO_PROGRESS_HELP = "no progress bar (there is none when stderr is not a terminal either)"


class UsageError(Exception):
    """A bad argument: reported as one line with exit code 2."""


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"world sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def _layout_names(text: str) -> list[str]:
    from .testing.layouts import parse_layouts

    try:
        return parse_layouts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cmd_validate(args: argparse.Namespace) -> int:
    from .testing import validate

    if args.layouts and not validate.layouts_fit(args.layouts, args.world_sizes):
        raise UsageError(
            f"no world size in {args.world_sizes} suits --layouts (2-D layouts run at even world sizes from 4)"
        )

    wrap = args.wrap or validate.default_wrap()
    if validate.under_torchrun():
        report = _validate_under_torchrun(args, wrap)
        if report is None:  # not rank 0
            return EXIT_OK
    else:
        from .testing.launcher import RankError, launch

        root = args.root
        with tempfile.TemporaryDirectory(prefix="ckpt-validate-") as tmp:
            root = root or tmp
            try:
                results = launch(
                    max(args.world_sizes),
                    validate.rank_entry,
                    root,
                    args.world_sizes,
                    wrap,
                    args.optim,
                    not args.json and _show_progress(args),
                    args.layouts,
                    args.pairs,
                    timeout=args.timeout,
                )
            except RankError as exc:
                # A rank crashed or hung inside a pair: the group cannot go on to the next pair.
                print(f"ckpt validate: FAILED, a rank stopped the run:\n{exc}", file=sys.stderr)
                return EXIT_FAIL
        report = validate.report_from_json(results[0])
        if not args.root:
            report.root = "(temporary directory on local disk)"
    if args.json:
        print(validate.dumps(report))
    else:
        what = f"layouts={','.join(report.layouts)}" if report.layouts else f"wrap={report.wrap}"
        print(f"ckpt validate: root={report.root} {what} optim={report.optim} backend={args.backend}")
        print(report.table())
        print("all pairs passed" if report.ok else "SOME PAIRS FAILED")
    return EXIT_OK if report.ok else EXIT_FAIL


def _validate_under_torchrun(args: argparse.Namespace, wrap: str):
    import torch.distributed as dist

    from .testing import validate

    if not args.root:
        raise UsageError("under torchrun, --root is required (a path, s3://, gs:// or az:// URI every rank can reach)")
    from .teardown import exit_barrier

    # gloo's C++ side prints "[Gloo] Rank ... connected" lines to stdout on some torch
    # versions; keep stdout for the report (JSON must parse) by pointing fd 1 at stderr.
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        dist.init_process_group(args.backend)
        try:
            progress = not args.json and _show_progress(args)
            if args.layouts:
                report = validate.run_layout_pairs(
                    args.root, args.world_sizes, args.layouts, args.optim, pairs=args.pairs, progress=progress
                )
            else:
                report = validate.run_pairs(args.root, args.world_sizes, wrap, args.optim, progress=progress)
            exit_barrier()
            return report
        finally:
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)


def _open(uri: str):
    """The storage for a URI the user typed; a bad URI is a usage error."""
    from .errors import StorageError
    from .storage import open_storage

    try:
        return open_storage(uri)
    except StorageError as exc:
        raise UsageError(str(exc)) from None


def _progress_bar(args: argparse.Namespace, desc: str, total: int | None = None, unit: str = "B"):
    """A tqdm bar on stderr, disabled unless `_show_progress(args)`."""
    from tqdm.auto import tqdm

    scale = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        disable=not _show_progress(args),
        leave=False,
        file=sys.stderr,
    )


def _cmd_verify(args: argparse.Namespace) -> int:
    from .format.verify import verify

    storage = _open(args.uri)
    bar = _progress_bar(args, "ckpt verify")

    def start(total: int) -> None:
        bar.reset(total=total)

    try:
        problems = verify(storage, on_start=start, on_bytes=bar.update)
    finally:
        bar.close()
    errors = [p for p in problems if p.is_error]
    for p in problems:
        print(p.line(storage.uri))
    if errors:
        print(f"{storage.uri}: DAMAGED, {len(errors)} problem{'s' if len(errors) != 1 else ''}")
        return EXIT_FAIL
    print(f"{storage.uri}: OK")
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .format.verify import summarize

    summary = summarize(_open(args.uri))
    if args.json:
        print(json.dumps(summary.to_json(), indent=1))
        return EXIT_OK

    def show(value):
        return "-" if value is None else value

    print(f"checkpoint:    {summary.uri}")
    print(f"format:        {summary.format}")
    print(f"step:          {show(summary.step)}")
    print(f"world size:    {show(summary.world_size)}")
    print(f"torch version: {show(summary.torch_version)}")
    print(f"total bytes:   {summary.total_bytes}")
    print(f"tensors:       {len(summary.tensors)}")
    if summary.tensors:
        width = max(len(t["key"]) for t in summary.tensors)
        for t in summary.tensors:
            shape = "(" + ", ".join(map(str, t["shape"])) + ("," if len(t["shape"]) == 1 else "") + ")"
            print(
                f"  {t['key']:<{width}}  {shape:<16} {t['dtype']:<10} "
                f"{t['chunks']} chunk{'s' if t['chunks'] != 1 else ''}"
            )
    print(f"objects:       {len(summary.objects)}" + (f" ({', '.join(summary.objects)})" if summary.objects else ""))
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert
    from .format.source import detect_format

    detect_format(args.src)  # not-a-checkpoint / missing: exit 2 with the reason
    result = convert(
        args.src,
        args.dst,
        to=args.to,
        force=args.force,
        progress=_show_progress(args),
        prefix=args.prefix,
        trusted=args.trusted,
    )
    print(
        f"converted {result.src} ({result.src_format}) -> {result.dst} ({result.to}): "
        f"{result.tensors} tensors, {result.objects} objects, {result.tensor_bytes} bytes in {result.seconds:.2f}s"
    )
    for note in result.notes:
        print(f"note: {note}")
    if result.skipped:
        print(f"skipped (not representable in {result.to}): {', '.join(result.skipped[:20])}")
    return EXIT_OK


def _show_progress(args: argparse.Namespace) -> bool:
    """A progress bar only on a terminal: never when stderr is piped or with --no-progress."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import export, parse_dtype, parse_size

    try:
        dtype = parse_dtype(args.dtype)
        shard = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    result = export(
        args.src,
        args.dst,
        format=args.format,
        dtype=dtype,
        max_shard_size=shard,
        model_only=args.model_only,
        step=args.step,
        force=args.force,
        progress=_show_progress(args),
        trusted=args.trusted,
    )
    rate = result.mib_per_s
    print(
        f"exported {result.src} ({result.src_format}, step {'-' if result.step is None else result.step}) -> "
        f"{result.dst} ({result.format}{', ' + result.dtype if result.dtype else ''}): {result.tensors} tensors, "
        f"{result.bytes} bytes in {len(result.files)} file{'s' if len(result.files) != 1 else ''}, "
        f"{result.seconds:.2f}s" + (f" ({rate:.1f} MiB/s)" if rate else "")
    )
    if result.skipped:
        shown = ", ".join(result.skipped[:10]) + (
            f" ... ({len(result.skipped)} in all)" if len(result.skipped) > 10 else ""
        )
        print(f"not exported: {shown}")
    return EXIT_OK


def _cmd_ls(args: argparse.Namespace) -> int:
    from .errors import CheckpointError
    from .format import MANIFEST_NAME, Manifest
    from .manager import LATEST, CheckpointManager, step_dir

    mgr = CheckpointManager(args.root)
    if not mgr.storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    pointer = mgr.storage.read_pointer(LATEST)
    holder = mgr.lock_holder()
    rows = []
    for info in mgr._scan():
        child = mgr.storage.child(info.name)
        row = {
            "step": info.step,
            "name": info.name,
            "state": info.state,
            "bytes": sum(info.files.values()),
            "size": sum(info.files.values()),
            "world_size": None,
            "latest": pointer == step_dir(info.step),
            "created": None,
            "age_seconds": None,
            "metrics": {},
        }
        if info.state == "committed":
            try:
                manifest = Manifest.from_bytes(child.read(MANIFEST_NAME), f"{child.uri}/{MANIFEST_NAME}")
            except CheckpointError:
                row["state"] = "corrupt"
            else:
                row["world_size"] = manifest.world_size
                row["created"] = manifest.created or None
                age = age_seconds(manifest.created)
                row["age_seconds"] = None if age is None else round(age, 3)
                row["metrics"] = dict(getattr(manifest, "metrics", None) or {})
        rows.append(row)
    if args.json:
        lock = holder.to_json() if holder is not None else None
        print(json.dumps({"root": args.root, "latest": pointer, "lock": lock, "steps": rows}, indent=1))
        return EXIT_OK
    print(f"{'step':>10}  {'state':<10} {'world':>5} {'size':>10} {'age':>6}  latest  metrics")
    for r in rows:
        ws = "-" if r["world_size"] is None else str(r["world_size"])
        metrics = " ".join(f"{k}={metric_text(v)}" for k, v in sorted(r["metrics"].items()))
        line = (
            f"{r['step']:>10}  {r['state']:<10} {ws:>5} {human_bytes(r['bytes']):>10} {human_age(r['age_seconds']):>6}"
            f"  {'*' if r['latest'] else '':<6}  {metrics}"
        )
        print(line.rstrip())
    if holder is not None:
        print(f"locked by {holder.describe()}")
    return EXIT_OK


def _run_bench(bench_args: list[str]) -> int:
    """`ckpt bench [scale | tensors] ARGS...`: the benchmarks of ckptlib.bench (in every install)."""
    with report_stdout():
        if bench_args[:1] == ["scale"]:
            from .bench import scale

            return scale.main(bench_args[1:])
        if bench_args[:1] == ["tensors"]:
            from .bench import tensor_counts

            return tensor_counts.main(bench_args[1:])
        from .bench import throughput

        return throughput.main(bench_args)


@contextlib.contextmanager
def report_stdout() -> Iterator[None]:
    """fd 1 points at stderr inside (ranks inherit it: gloo's C++ side prints "connected"
    lines to stdout on some torch versions), while Python's sys.stdout keeps the real stdout
    for the report, so `--json` output parses."""
    sys.stdout.flush()
    try:
        on_fd1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # captured or replaced: it does not write to fd 1
        on_fd1 = False
    saved = os.dup(1)
    os.dup2(2, 1)
    previous = sys.stdout
    if on_fd1:
        sys.stdout = os.fdopen(saved, "w", closefd=False)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = previous
        os.dup2(saved, 1)
        os.close(saved)


def _cmd_unlock(args: argparse.Namespace) -> int:
    from .manager import CheckpointManager

    mgr = CheckpointManager(args.root)
    if not mgr.storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    holder = mgr.break_lock()
    if holder is None:
        print(f"{mgr.storage.uri}: not locked")
    else:
        print(f"{mgr.storage.uri}: removed the lock held by {holder.describe()}")
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from .manager import CheckpointManager
    from .retention import KeepEvery, KeepLast, parse_keep_best

    if args.keep is not None and args.keep_last is not None:
        raise UsageError("--keep is --keep-last; give one of them")
    keep_last = args.keep if args.keep is not None else args.keep_last
    for flag, value in (("--keep", args.keep), ("--keep-last", args.keep_last), ("--keep-every", args.keep_every)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1")
    policies = []
    try:
        if keep_last is not None:
            policies.append(KeepLast(keep_last))
        if args.keep_every is not None:
            policies.append(KeepEvery(args.keep_every))
        policies.extend(parse_keep_best(spec) for spec in args.keep_best)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not policies:
        raise UsageError("say what to keep: --keep-last N, --keep-every K and/or --keep-best K:METRIC[:min|max]")
    retention = policies[0]
    for policy in policies[1:]:
        retention = retention | policy
    mgr = CheckpointManager(args.root, retention=retention)
    if not mgr.storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    if args.force and not args.dry_run:
        holder = mgr.break_lock()
        if holder is not None:
            print(f"removed the lock held by {holder.describe()}")
    bar = _progress_bar(args, "ckpt gc", unit="dir")

    def on_removed(done: int, total: int) -> None:
        if bar.total != total:
            bar.reset(total=total)
        bar.n = done
        bar.refresh()

    try:
        removed = mgr.gc(dry_run=args.dry_run, on_removed=on_removed)
    finally:
        bar.close()
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} {mgr.storage.uri.rstrip('/')}/{name}")
    print(f"{verb} {len(removed)} step director{'y' if len(removed) == 1 else 'ies'}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description=(
            "Elastic sharded checkpoints for PyTorch: validate a setup; verify, inspect and manage checkpoints."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate",
        help="save at N ranks and load at M ranks for every pair; print the pass/fail matrix",
        description=(
            "Run the save-at-N/load-at-M round trip (train, save, load, compare bit-exactly, train one "
            "more step against a never-checkpointed run) for every pair of world sizes. Without torchrun "
            "it starts max(world sizes) local gloo ranks on a temporary directory (or --root). Under "
            "torchrun it uses the launched ranks and --root (a shared path, s3://, gs:// or az:// URI). With "
            "--layouts, the pairs are (layout A at N ranks) saved and (layout B at M ranks) loaded, e.g. a run "
            "trained with FSDP2 x TP resuming with FSDP2 on fewer ranks."
        ),
    )
    p.add_argument("--world-sizes", type=_world_sizes, default=[1, 2, 3, 4], help="comma-separated (default 1,2,3,4)")
    p.add_argument(
        "--root",
        default=None,
        help="where to write the test checkpoints: a path, s3://, gs:// or az:// URI (default: a temp dir)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--wrap",
        choices=["fsdp2", "ddp", "plain"],
        default=None,
        help="model wrapping (default fsdp2 when supported, else ddp)",
    )
    p.add_argument(
        "--layouts",
        type=_layout_names,
        default=None,
        metavar="LIST",
        help=(
            "comma-separated parallelism layouts to save from and load into, e.g. fsdp2,hsdp,tp,fsdp2+tp (choices: "
            "plain, ddp, fsdp2, hsdp, tp, fsdp2+tp, fsdp1, fsdp1-flat; 2-D layouts run at even world sizes from 4 "
            "as 2 x N/2). Runs a small transformer; every pair names its save and load layout"
        ),
    )
    p.add_argument(
        "--pairs",
        choices=["all", "covering"],
        default="all",
        help="with --layouts: every (layout, world "
        "size) loaded at every other (all), or one case per (save, load) layout pair (covering)",
    )
    p.add_argument("--optim", choices=["adam", "adamw", "sgd"], default="adamw")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="process group backend under torchrun")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung rank fails the run")
    p.add_argument("--no-progress", action="store_true", help=_NO_PROGRESS_HELP)
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser(
        "verify",
        help="check a checkpoint's files against its manifest and its metadata",
        description=(
            "Read every file of one checkpoint and check it: the manifest, each file's size and CRC-32 "
            "(whole file and every item), that every tensor's saved chunks cover it exactly, and that every "
            "storage record lies inside the directory and its file. .metadata is unpickled with an allowlist "
            "only. A plain DCP checkpoint has no checksums: its structure is checked. Prints one line per "
            "problem, naming the file. Exit status: 0 intact, 1 damaged, 2 no checkpoint at URI."
        ),
    )
    p.add_argument("uri", help="a checkpoint directory: path, file://, s3://, gs:// or az:// URI")
    p.add_argument("--no-progress", action="store_true", help=_NO_PROGRESS_HELP)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "inspect",
        help="describe a checkpoint: format, step, world size, tensors",
        description=(
            "Show a checkpoint's format (ckptlib or dcp), step, saved world size, torch version, total bytes "
            "and every tensor's key, shape, dtype and number of saved chunks, from its manifest and .metadata "
            "(no shard is read; use `ckpt verify` to check the data)."
        ),
    )
    p.add_argument("uri", help="a checkpoint directory: path, file://, s3://, gs:// or az:// URI")
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON with the keys format, step, world_size, torch_version, total_bytes, tensors "
        "(a list of {key, shape, dtype, chunks})",
    )
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "ls",
        help="list the steps under a checkpoint root",
        description=(
            "List steps: committed, incomplete or corrupt (or foreign: only files ckptlib did not write), size, "
            "age (since the manifest was written), saved "
            "world size, which is latest, the metrics given to the save, and who holds the root's lock. "
            "--json: root, latest, lock and steps (each with step, name, state, bytes (= size), world_size, "
            "latest, created, age_seconds, metrics)."
        ),
    )
    p.add_argument("root", help="a checkpoint root: path, file://, s3://, gs:// or az:// URI")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser(
        "gc",
        help="apply retention to a checkpoint root",
        description=(
            "Apply retention to ROOT and remove incomplete debris (only files ckptlib wrote: a step directory that "
            "also holds other files keeps them). A committed "
            "step is kept when any rule keeps it: --keep-last N (the N highest steps), --keep-every K (steps that "
            "are multiples of K), --keep-best K:METRIC[:min|max] (the K best by a metric saved with the step; "
            "steps without it are not best; a tie keeps the newer step). The step `latest` names is always kept. "
            "The rules are CheckpointManager's retention policies (KeepLast | KeepEvery | KeepBest). "
            "Takes the root's lock: fails (exit 1) while a writer holds it."
        ),
    )
    p.add_argument("root", help="a checkpoint root: path, file://, s3://, gs:// or az:// URI")
    p.add_argument(
        "--keep-last", type=int, default=None, metavar="N", help="keep the N highest-numbered committed steps"
    )
    p.add_argument("--keep", type=int, default=None, metavar="N", help="same as --keep-last N")
    p.add_argument("--keep-every", type=int, default=None, metavar="K", help="keep every step that is a multiple of K")
    p.add_argument(
        "--keep-best",
        action="append",
        default=[],
        metavar="K:METRIC[:min|max]",
        help="keep the K best steps by METRIC (a name without ':', saved with metrics=...; min is best unless :max); "
        "repeatable",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="first remove the root's lock, whoever holds it (only when that writer is known to be gone)",
    )
    p.add_argument("--no-progress", action="store_true", help=_NO_PROGRESS_HELP)
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser(
        "convert",
        help="convert any readable checkpoint to ckptlib/DCP, one torch.save file, or safetensors",
        description=(
            "Convert SRC (ckptlib, plain DCP from torch >= 2.0, a torch.save file, v0 per-rank files, "
            "safetensors) to DST, streaming one tensor at a time. --to dcp writes a committed ckptlib "
            "checkpoint loadable at any world size; --to torch one torch.save file of full tensors with the "
            "saved nesting; --to safetensors the model tensors. Refuses to overwrite DST without --force."
        ),
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", choices=["dcp", "torch", "safetensors"], default="dcp", help="target format (default dcp)")
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    p.add_argument(
        "--prefix",
        default="model",
        help="state key that holds flat model files / is exported to safetensors (default model)",
    )
    p.add_argument("--trusted", action="store_true", help="allow arbitrary unpickling of objects in torch.save sources")
    p.add_argument("--no-progress", action="store_true", help=_NO_PROGRESS_HELP)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "export",
        help="export a checkpoint as one consolidated model in Hugging Face's layout",
        description=(
            "Write SRC (any checkpoint ckptlib reads, at any saved world size, or a CheckpointManager root: its "
            "latest step, or --step) as one consolidated model in DST, streaming one tensor at a time. "
            "--format safetensors: model.safetensors, or model-0000k-of-0000n.safetensors plus "
            "model.safetensors.index.json when the tensors exceed --max-shard-size. --format torch: "
            "pytorch_model.bin (torch.save of a flat name->tensor dict), or pytorch_model-0000k-of-0000n.bin plus "
            "pytorch_model.bin.index.json. A DST ending in .safetensors (.bin/.pt/.pth for torch) is one file. "
            "--model-only writes the 'model' entry's tensors without the 'model.' prefix (the names "
            "transformers' loaders expect); otherwise every tensor under its full key. Non-tensor values are "
            "never exported. Refuses to write into an existing DST unless --force, and even then only when DST "
            "is an export ckptlib wrote (ckptlib_export.json lists its files)."
        ),
    )
    p.add_argument("src", help="a checkpoint (path, file://, s3://, gs:// or az:// URI) or a CheckpointManager root")
    p.add_argument("dst", help="a local directory (or one .safetensors/.bin file)")
    p.add_argument("--format", choices=["safetensors", "torch"], default="safetensors", help="default safetensors")
    p.add_argument(
        "--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16 (integer tensors keep theirs)"
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest shard: bytes or 5GB / 500MB / 2GiB as Hugging Face spells it (default 5GB); "
        "a larger tensor gets a shard of its own",
    )
    p.add_argument("--model-only", action="store_true", help="only the model's tensors, without the 'model.' prefix")
    p.add_argument("--step", type=int, default=None, help="with a CheckpointManager root: this step instead of latest")
    p.add_argument("--force", action="store_true", help="replace an export ckptlib wrote earlier at DST")
    p.add_argument("--trusted", action="store_true", help="allow arbitrary unpickling of objects in torch.save sources")
    p.add_argument("--no-progress", action="store_true", help=_NO_PROGRESS_HELP)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "unlock",
        help="remove a checkpoint root's writer lock",
        description=(
            "Remove the lock (ckptlib.lock) a writer left in a checkpoint root. A lock whose holder died on "
            "the same host is removed automatically; use this for a holder on another host that is known to "
            "be gone. Removing the lock of a live writer lets two writers interleave."
        ),
    )
    p.add_argument("root", help="a checkpoint root: path, file://, s3://, gs:// or az:// URI")
    p.set_defaults(func=_cmd_unlock)

    # Listed for `ckpt --help`; main() hands everything after `bench` to ckptlib.bench
    # (argparse's REMAINDER would refuse a first argument that starts with "--").
    sub.add_parser(
        "bench",
        help="benchmark ckptlib against raw DCP, torch.save, the disk and each cloud SDK",
        description="Runs ckptlib.bench.throughput; `ckpt bench --help` lists its options. `ckpt bench scale` "
        "(planning time and memory, .metadata and manifest sizes at simulated world sizes; no ranks spawned; --s3 "
        "adds the S3 request counts of real saves and loads on moto). `ckpt bench tensors` (save and load of 16 to "
        "10,000 small tensors against raw DCP).",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, CheckpointNotFoundError, NotACheckpointError) as exc:
        print(f"ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as exc:  # e.g. permission denied reading a file
        print(f"ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE"]
