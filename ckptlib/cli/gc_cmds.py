"""`ckpt gc` and `ckpt unlock`: the commands that change a checkpoint root (retention, debris,
the writer lock)."""

from __future__ import annotations

import argparse
import json

from ckptlib.cli.usage import EXIT_OK, ROOT_URI_HELP, UsageError, add_command, add_json, add_no_progress, progress_bar

GC_DESCRIPTION = """
Apply retention to ROOT and remove incomplete debris (only files ckptlib wrote: a step
directory that also holds other files keeps them). A committed step is kept when any rule
keeps it: --keep-last N (the N highest steps), --keep-every K (steps that are multiples of K),
--keep-best K:METRIC[:min|max] (the K best by a metric saved with the step; steps without it
are not best; a tie keeps the newer step). The step `latest` names is always kept. The rules
are CheckpointManager's retention policies (KeepLast | KeepEvery | KeepBest).

Debris: step directories whose save never committed, and what an interrupted deletion left
behind. Steps that hold only files ckptlib did not write (foreign in `ckpt ls`) are never
touched. Prints one line per step directory removed and their count (a step directory that
also holds other files is not removed: a one-line warning on stderr names those files);
--dry-run prints exactly what the real run would remove and removes nothing.

Takes the root's lock: fails (exit 1) while a writer holds it (--force removes it first);
--dry-run does not take it, but fails alike while another writer holds it (with --force it
says it would remove the lock).

Exit status: 0 done; 1 the root is locked, or a storage error; 2 usage error (no rule, a bad
value, no such root).
"""

UNLOCK_DESCRIPTION = """
Remove the lock (ckptlib.lock) a writer left in a checkpoint root. A lock whose holder died on
the same host, or whose lease was not renewed for longer than the lease (CKPTLIB_LOCK_LEASE_S,
default 120 s; any host), is removed automatically; use this for an older lock without a
lease whose holder on another host is known to be gone. Removing the lock of a live writer
lets two writers interleave.

Prints whose lock it removed, or that the root was not locked.

Exit status: 0 removed or not locked; 1 a storage error; 2 no such checkpoint root.
"""


def add_gc_parser(commands) -> None:
    p = add_command(commands, "gc", help="apply retention to a checkpoint root", description=GC_DESCRIPTION)
    p.add_argument("root", help=ROOT_URI_HELP)
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
    add_json(
        p,
        "root, dry_run, removed (the step directories removed, or that would be) and lock_removed (the lock --force "
        "removed, or would remove with --dry-run, or null)",
    )
    add_no_progress(p)
    p.set_defaults(func=run_gc)


def add_unlock_parser(commands) -> None:
    p = add_command(commands, "unlock", help="remove a checkpoint root's writer lock", description=UNLOCK_DESCRIPTION)
    p.add_argument("root", help=ROOT_URI_HELP)
    add_json(p, "root and removed (the lock removed: {token, host, pid, created, ...}, or null when not locked)")
    p.set_defaults(func=run_unlock)


def run_gc(args: argparse.Namespace) -> int:
    from ckptlib.manager.manager import CheckpointManager
    from ckptlib.manager.policies import KeepEvery, KeepLast, parse_keep_best

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
    holder = None
    if args.force:
        holder = mgr.lock_holder() if args.dry_run else mgr.break_lock()
        if holder is not None and not args.json:
            print(f"{'would remove' if args.dry_run else 'removed'} the lock held by {holder.describe()}")
    elif args.dry_run:
        mgr.check_lock()  # the real run's LockedError: a dry run reports what the real run would do
    bar = progress_bar(args, "ckpt gc", unit="dir")

    def on_removed(done: int, total: int) -> None:
        if bar.total != total:
            bar.reset(total=total)
        bar.n = done
        bar.refresh()

    try:
        removed = mgr.gc(dry_run=args.dry_run, on_removed=on_removed)
    finally:
        bar.close()
    if args.json:
        doc = {
            "root": mgr.storage.uri,
            "dry_run": args.dry_run,
            "removed": list(removed),
            "lock_removed": None if holder is None else holder.to_json(),
        }
        print(json.dumps(doc, indent=1))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} {mgr.storage.uri.rstrip('/')}/{name}")
    print(f"{verb} {len(removed)} step director{'y' if len(removed) == 1 else 'ies'}")
    return EXIT_OK


def run_unlock(args: argparse.Namespace) -> int:
    from ckptlib.manager.manager import CheckpointManager

    mgr = CheckpointManager(args.root)
    if not mgr.storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    holder = mgr.break_lock()
    if args.json:
        print(json.dumps({"root": mgr.storage.uri, "removed": None if holder is None else holder.to_json()}, indent=1))
    elif holder is None:
        print(f"{mgr.storage.uri}: not locked")
    else:
        print(f"{mgr.storage.uri}: removed the lock held by {holder.describe()}")
    return EXIT_OK
