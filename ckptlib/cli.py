"""The `ckpt` command: validate a cluster/storage pair, and operate on checkpoint roots.

Exit codes: 0 success, 1 a check failed (validation failure, damaged checkpoint),
2 usage errors or a path that is not what the command needs. User errors print one
line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


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


def _cmd_validate(args: argparse.Namespace) -> int:
    from .testing import validate

    wrap = args.wrap or validate.default_wrap()
    if validate.under_torchrun():
        report = _validate_under_torchrun(args, wrap)
        if report is None:  # not rank 0
            return EXIT_OK
    else:
        from .testing.launcher import launch

        root = args.root
        with tempfile.TemporaryDirectory(prefix="ckpt-validate-") as tmp:
            root = root or tmp
            results = launch(
                max(args.world_sizes),
                validate.rank_entry,
                root,
                args.world_sizes,
                wrap,
                args.optim,
                not args.json and not args.no_progress,
                timeout=args.timeout,
            )
        report = validate.report_from_json(results[0])
        if not args.root:
            report.root = "(temporary directory on local disk)"
    if args.json:
        print(validate.dumps(report))
    else:
        print(f"ckpt validate: root={report.root} wrap={report.wrap} optim={report.optim} backend={args.backend}")
        print(report.table())
        print("all pairs passed" if report.ok else "SOME PAIRS FAILED")
    return EXIT_OK if report.ok else EXIT_FAIL


def _validate_under_torchrun(args: argparse.Namespace, wrap: str):
    import torch.distributed as dist

    from .testing import validate

    if not args.root:
        raise UsageError("under torchrun, --root is required (a path or s3:// URI every rank can reach)")
    backend = args.backend
    dist.init_process_group(backend)
    try:
        return validate.run_pairs(args.root, args.world_sizes, wrap, args.optim, progress=not args.json)
    finally:
        dist.destroy_process_group()


def _cmd_ls(args: argparse.Namespace) -> int:
    from .format import MANIFEST_NAME, Manifest
    from .manager import LATEST, CheckpointManager, step_dir

    mgr = CheckpointManager(args.root)
    if not mgr.storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    pointer = mgr.storage.read_pointer(LATEST)
    rows = []
    for info in mgr._scan():
        child = mgr.storage.child(info.name)
        files = child.list()
        row = {
            "step": info.step,
            "name": info.name,
            "state": info.state,
            "bytes": sum(files.values()),
            "world_size": None,
            "latest": pointer == step_dir(info.step),
        }
        if info.state == "committed":
            row["world_size"] = Manifest.from_bytes(child.read(MANIFEST_NAME), f"{child.uri}/{MANIFEST_NAME}").world_size
        rows.append(row)
    if args.json:
        print(json.dumps({"root": args.root, "latest": pointer, "steps": rows}, indent=1))
        return EXIT_OK
    print(f"{'step':>10}  {'state':<10} {'world':>5} {'bytes':>12}  latest")
    for r in rows:
        ws = "-" if r["world_size"] is None else str(r["world_size"])
        print(f"{r['step']:>10}  {r['state']:<10} {ws:>5} {r['bytes']:>12}  {'*' if r['latest'] else ''}")
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from .manager import CheckpointManager

    if args.keep < 1:
        raise UsageError("--keep must be at least 1")
    mgr = CheckpointManager(args.root, keep_last=args.keep)
    if not mgr.storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    removed = mgr.gc(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} {mgr.storage.uri.rstrip('/')}/{name}")
    print(f"{verb} {len(removed)} step director{'y' if len(removed) == 1 else 'ies'}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description="Elastic sharded checkpoints for PyTorch: validate, inspect and manage them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate",
        help="save at N ranks and load at M ranks for every pair; print the pass/fail matrix",
        description=(
            "Run the save-at-N/load-at-M round trip (train, save, load, compare bit-exactly, train one "
            "more step against a never-checkpointed run) for every pair of world sizes. Without torchrun "
            "it starts max(world sizes) local gloo ranks on a temporary directory (or --root). Under "
            "torchrun it uses the launched ranks and --root (a shared path or s3:// URI)."
        ),
    )
    p.add_argument("--world-sizes", type=_world_sizes, default=[1, 2, 3, 4], help="comma-separated (default 1,2,3,4)")
    p.add_argument("--root", default=None, help="where to write the test checkpoints (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--wrap", choices=["fsdp2", "ddp", "plain"], default=None, help="model wrapping (default fsdp2 when supported, else ddp)")
    p.add_argument("--optim", choices=["adam", "adamw", "sgd"], default="adamw")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="process group backend under torchrun")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung rank fails the run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("ls", help="list the steps under a checkpoint root", description="List steps: committed or incomplete, size, saved world size, which is latest.")
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("gc", help="apply retention to a checkpoint root", description="Keep the newest N committed steps (never the one `latest` names) and remove incomplete debris.")
    p.add_argument("root")
    p.add_argument("--keep", type=int, required=True, help="number of newest committed steps to keep")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.set_defaults(func=_cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import CheckpointError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"ckpt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE"]
