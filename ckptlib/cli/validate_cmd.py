"""`ckpt validate`: the save-at-N / load-at-M round trip on the user's storage and cluster, run
by local ranks or under torchrun (the pairs themselves are `ckptlib.testing.matrices.validate`'s)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from ckptlib.cli.usage import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError, add_command, add_no_progress, show_progress

DESCRIPTION = """
Run the save-at-N/load-at-M round trip (train, save, load, compare bit-exactly, train one more
step against a never-checkpointed run) for every pair of world sizes. Without torchrun it
starts max(world sizes) local gloo ranks on a temporary directory (or --root). Under torchrun
it uses the launched ranks and --root (a shared path, s3://, gs:// or az:// URI every rank can
reach); each pair runs on a subgroup of the first N (or M) launched ranks, so no world size may
exceed the ranks launched.

With --layouts, the pairs are (layout A at N ranks) saved and (layout B at M ranks) loaded,
e.g. a run trained with FSDP2 x TP resuming with FSDP2 on fewer ranks; a small transformer
is trained, and every pair names its save and load layout.

With --spec pkg.module:NAME (or path/to/file.py:NAME, or a module or file alone), the pairs
run YOUR training job: its model, optimizers, LR schedulers, per-rank state (ckptlib.RankLocal,
e.g. RNG) and data loaders, from the spec's factory functions (build_model(seed) required;
build_optimizers, build_schedulers, build_state, train_step or loss, fsdp_units, tp_plan;
see docs/layouts.md). Every part must come back bit-exactly, per-rank state as its resize
policy says, and one more training step must equal a run that got the saved state without a
checkpoint. The layouts are --layouts, else the spec's LAYOUTS, else fsdp2. An exception in
the spec's own functions stops the run with exit status 2 and the failing rank's traceback.

Writes the test checkpoints under --root, in a directory ckpt-validate-<id> of its own, and
removes that directory at the end. Prints the matrix (rows: saved at N; columns: loaded at M;
pass/FAIL and seconds per cell, then each failing pair's reason) and "all pairs passed" or
"SOME PAIRS FAILED"; --json prints the report as JSON instead (ok, root, wrap, optim,
world_sizes, layouts, cells). Under torchrun only rank 0 prints.

With --crash REF: the crash harness for checkpointer REF instead of the matrix (see --crash);
it prints each rank's write boundaries, the outcome of each kill and every violation with the
calls that led to it and a line that reproduces it, then "crash consistent" or "NOT CRASH
CONSISTENT" (exit status 0 or 1; 2 for a REF that names no checkpointer).

Exit status: 0 every pair passed; 1 a pair failed, a rank crashed, or the local run outlasted
--timeout (the reason goes to stderr); 2 usage error, or a --spec that does not import or whose
functions raised (SpecError: the rank and the traceback go to stderr).
"""


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"world sizes must be positive integers, got {text!r}")
    return sorted(set(sizes))


def _layout_names(text: str) -> list[str]:
    from ckptlib.testing.matrices.parallel_layouts import parse_layouts

    try:
        return parse_layouts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(commands) -> None:
    p = add_command(
        commands,
        "validate",
        help="save at N ranks and load at M ranks for every pair; print the pass/fail matrix",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--world-sizes",
        type=_world_sizes,
        default=[1, 2, 3, 4],
        help="comma-separated world sizes to save and load at (default 1,2,3,4)",
    )
    p.add_argument(
        "--root",
        default=None,
        help="where to write the test checkpoints: a path, s3://, gs:// or az:// URI (default: a temp dir; "
        "required under torchrun)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--wrap",
        choices=["fsdp2", "ddp", "plain"],
        default=None,
        help="model wrapping (default fsdp2 when supported, else ddp); not used with --layouts",
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
        "--spec",
        default=None,
        metavar="REF",
        help="validate your own training job: pkg.module:NAME, path/to/file.py:NAME, or a module or file whose "
        "factory functions (build_model(seed), build_optimizers(model), build_schedulers(optimizers), "
        "build_state(rank, world_size), train_step(training, step) or loss(model, batch), ...) describe it",
    )
    p.add_argument(
        "--pairs",
        choices=["all", "covering"],
        default="all",
        help="with --layouts: every (layout, world size) saved and loaded at every other (all, default), or one "
        "case per (save layout, load layout) pair with world sizes rotated (covering)",
    )
    p.add_argument(
        "--optim", choices=["adam", "adamw", "sgd"], default="adamw", help="the test model's optimizer (default adamw)"
    )
    p.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="process group backend under torchrun (local ranks always use gloo)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the whole local run may take before its ranks are stopped and it fails (default 600; "
        "not used under torchrun)",
    )
    p.add_argument(
        "--crash",
        nargs="?",
        const=True,
        default=None,
        metavar="REF",
        help="the crash harness instead of the matrix: kill the save of checkpointer REF (pkg.module:attr, an object "
        "with save(root, step, state) and load(root, state)) at every write boundary, in one rank and then in every "
        "rank, and check that its own load resumes a step bit-exactly or raises (ckptlib.testing.crash_check; docs/"
        "testing.md). Runs local ranks at the largest of --world-sizes; --wrap is the state's wrapping (default plain)",
    )
    p.add_argument(
        "--crash-max-points",
        type=int,
        default=None,
        metavar="N",
        help="with --crash: at most N boundaries, spread over every rank (default: all)",
    )
    p.add_argument(
        "--crash-points",
        type=lambda text: [part.strip() for part in text.split(",") if part.strip()],
        default=None,
        metavar="LIST",
        help="with --crash: exactly these boundaries, comma-separated RANK#INDEX (as a reproduction names them)",
    )
    add_no_progress(p)
    p.set_defaults(func=run)


def _spec_layouts(args: argparse.Namespace) -> None:
    """Check --spec in this process (a SpecError is a usage-level error) and pick its layouts."""
    from ckptlib.testing.matrices.training_spec import load_spec, resolve_reference

    args.spec = resolve_reference(args.spec)
    spec = load_spec(args.spec)
    if not args.layouts:
        try:
            args.layouts = _layout_names(",".join(spec.layouts))
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"spec {args.spec}: LAYOUTS: {exc}") from None


#: torch's C++ warnings (c10d's "socket.cpp ... timed out" while a rank waits for the store)
#: would print above the report; a level the user set is kept. Read when torch loads, so it is
#: set before anything imports torch here, and the ranks' forkserver inherits it.
QUIET_TORCH_CPP = ("TORCH_CPP_LOG_LEVEL", "ERROR")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault(*QUIET_TORCH_CPP)
    from ckptlib.testing.matrices import validate
    from ckptlib.testing.matrices.training_spec import SpecError

    if args.crash is not None:
        return _run_crash(args, validate)
    try:
        if args.spec:
            _spec_layouts(args)
        return _run(args, validate)
    except SpecError as exc:
        # Under torchrun every rank that raised gets here: rank 0 and the rank it started on say it.
        rank = int(os.environ.get("RANK", "0")) if validate.under_torchrun() else 0
        if rank == 0 or exc.rank == rank:
            print(f"ckpt validate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace, validate) -> int:
    if args.layouts and not validate.layouts_fit(args.layouts, args.world_sizes):
        raise UsageError(
            f"no world size in {args.world_sizes} suits --layouts {','.join(args.layouts)} "
            "(2-D layouts run at even world sizes from 4)"
        )

    wrap = args.wrap or validate.default_wrap()
    if validate.under_torchrun():
        report = _validate_under_torchrun(args, wrap)
        if report is None:  # not rank 0
            return EXIT_OK
    else:
        from ckptlib.testing.harness.launch_errors import RankError
        from ckptlib.testing.harness.launcher import launch

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
                    not args.json and show_progress(args),
                    args.layouts,
                    args.pairs,
                    args.spec,
                    timeout=args.timeout,
                )
            except RankError as exc:
                from ckptlib.testing.matrices.elastic_proof import spec_error_of

                failure = spec_error_of(exc)
                if failure is not None:
                    raise failure from None
                # A rank crashed or hung inside a pair: the group cannot go on to the next pair.
                print(f"ckpt validate: FAILED, a rank stopped the run:\n{exc}", file=sys.stderr)
                return EXIT_FAIL
        report = validate.report_from_json(results[0])
        if not args.root:
            report.root = "(temporary directory on local disk)"
    if args.json:
        print(validate.dumps(report))
    else:
        if report.spec:
            what = f"spec={report.spec} layouts={','.join(report.layouts or [])}"
        elif report.layouts:
            what = f"layouts={','.join(report.layouts)}"
        else:
            what = f"wrap={report.wrap}"
        optim = f" optim={report.optim}" if report.optim else ""
        print(f"ckpt validate: root={report.root} {what}{optim} backend={args.backend}")
        print(report.table())
        print("all pairs passed" if report.ok else "SOME PAIRS FAILED")
    return EXIT_OK if report.ok else EXIT_FAIL


def _validate_under_torchrun(args: argparse.Namespace, wrap: str):
    import torch.distributed as dist

    from ckptlib.testing.matrices import validate

    if not args.root:
        raise UsageError("under torchrun, --root is required (a path, s3://, gs:// or az:// URI every rank can reach)")
    from ckptlib._runtime.teardown import exit_barrier

    # gloo's C++ side prints "[Gloo] Rank ... connected" lines to stdout on some torch
    # versions; keep stdout for the report (JSON must parse) by pointing fd 1 at stderr.
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        dist.init_process_group(args.backend)
        try:
            progress = not args.json and show_progress(args)
            if args.layouts:
                report = validate.run_layout_pairs(
                    args.root,
                    args.world_sizes,
                    args.layouts,
                    args.optim,
                    pairs=args.pairs,
                    progress=progress,
                    spec=args.spec,
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


def _run_crash(args: argparse.Namespace, validate) -> int:
    """`--crash`: the crash harness for the checkpointer named (`ckptlib.testing.crash_check`)."""
    import json

    from ckptlib.testing.checkpointers.crash_check import crash_check
    from ckptlib.testing.checkpointers.protocol import CheckpointerError

    ref = args.crash if isinstance(args.crash, str) else getattr(args, "checkpointer", None)
    if not ref:
        raise UsageError("--crash needs a checkpointer: --crash pkg.module:attr")
    if validate.under_torchrun():
        raise UsageError("--crash starts its own local ranks: run it without torchrun")
    try:
        report = crash_check(
            ref,
            world_size=max(args.world_sizes),
            root=args.root,
            wrap=args.wrap or "plain",
            optim=args.optim,
            max_points=args.crash_max_points,
            points=args.crash_points,
        )
    except CheckpointerError as exc:
        print(f"ckpt validate: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(report.to_dict()) if args.json else report.text())
    return EXIT_OK if report.ok else EXIT_FAIL
