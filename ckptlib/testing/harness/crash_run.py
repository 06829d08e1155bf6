"""Drive the crash harness: enumerate an operation's write boundaries (`enumerate_boundaries`),
run a kill case and a fail case at each (`run_operation`), and write the report of boundaries
per operation (`report`, docs/crash-boundaries.md).

Regenerate the report (starts its own moto S3 server on 127.0.0.1):

    python -m ckptlib.testing.harness.crash_run --write docs/crash-boundaries.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
import traceback

from ckptlib.testing.harness.crash_operations import OPERATIONS, Operation
from ckptlib.testing.harness.crash_points import Boundary, Outcome, run_case
from ckptlib.testing.harness.crash_scene import Scene, assert_named_error

MODES = ("kill", "fail")
REPORT_COMMAND = "python -m ckptlib.testing.harness.crash_run --write docs/crash-boundaries.md"


@dataclasses.dataclass
class CaseResult:
    """One case: operation, backend, mode, the boundary, and what went wrong ("" when nothing)."""

    operation: str
    backend: str
    mode: str
    boundary: Boundary
    status: str
    problem: str = ""

    @property
    def id(self) -> str:
        return f"{self.operation}-{self.backend}-{self.mode}-{self.boundary.label()}"


@contextlib.contextmanager
def without_fsync():
    """`os.fsync` does nothing meanwhile (the children forked inside inherit that). Durability
    against power loss is not what a killed process tests: its writes stay in the page cache.
    The probes still count every fsync call as a boundary, and fail cases still fail them."""
    real = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


def _scene(operation: Operation, backend: str, workdir: str, s3_base: str | None, name: str) -> Scene:
    scene = Scene.make(backend, tempfile.mkdtemp(prefix=f"{name}-", dir=workdir), s3_base)
    operation.prepare(scene)
    return scene


def _act(operation: Operation, scene: Scene):
    return lambda: operation.act(scene)


def enumerate_boundaries(
    operation: Operation, backend: str, workdir: str, s3_base: str | None = None, *, timeout: float = 60.0
) -> list[Boundary]:
    """The write boundaries `operation` performs on `backend`, in order, from a run that
    completes (AssertionError if it does not)."""
    scene = _scene(operation, backend, workdir, s3_base, f"{operation.name}-{backend}-record")
    outcome = run_case(_act(operation, scene), scene.watch(), "record", timeout=timeout)
    assert outcome.status == "completed", (
        f"{operation.name} on {backend} did not complete undisturbed: {outcome.status} "
        f"{outcome.error_type}: {outcome.error_message}\n{outcome.error_traceback or ''}"
    )
    operation.check(scene, outcome)
    return outcome.boundaries


def _judge(operation: Operation, scene: Scene, outcome: Outcome, mode: str, boundary: Boundary) -> str:
    k = boundary.index
    if outcome.status in ("hung", "crashed"):
        return f"the child {outcome.status} (exit code {outcome.exitcode})"
    if mode == "kill":
        if outcome.status != "killed":
            return f"never reached boundary {k} ({len(outcome.boundaries)} boundaries this time): {outcome.status}"
        if outcome.killed_at != boundary:
            return f"boundary {k} is {outcome.killed_at.label()} this time: the operation is not deterministic"
    else:
        if len(outcome.boundaries) <= k or outcome.boundaries[k] != boundary:
            seen = outcome.boundaries[k].label() if len(outcome.boundaries) > k else "nothing"
            return f"boundary {k} is {seen} this time: the operation is not deterministic"
        if outcome.status == "raised":
            assert_named_error(scene, outcome, k)
    operation.check(scene, outcome)
    return ""


def run_operation(
    operation: Operation,
    backend: str,
    workdir: str,
    s3_base: str | None = None,
    *,
    modes: tuple[str, ...] = MODES,
    only: list[int] | None = None,
    timeout: float = 60.0,
) -> tuple[list[Boundary], list[CaseResult]]:
    """Enumerate the boundaries, then run each mode at each boundary (or at `only`)."""
    with without_fsync():
        return _run_operation(operation, backend, workdir, s3_base, modes, only, timeout)


def _run_operation(operation, backend, workdir, s3_base, modes, only, timeout):
    boundaries = enumerate_boundaries(operation, backend, workdir, s3_base, timeout=timeout)
    results = []
    for boundary in boundaries:
        if only is not None and boundary.index not in only:
            continue
        for mode in modes:
            name = f"{operation.name}-{backend}-{mode}-{boundary.index}"
            scene = _scene(operation, backend, workdir, s3_base, name)
            outcome = run_case(_act(operation, scene), scene.watch(), mode, boundary.index, timeout=timeout)
            try:
                problem = _judge(operation, scene, outcome, mode, boundary)
            except Exception as exc:  # noqa: BLE001 - an invariant broken: reported with the case
                problem = f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, AssertionError):
                    problem += "\n" + traceback.format_exc(limit=-4)
            results.append(CaseResult(operation.name, backend, mode, boundary, outcome.status, problem))
    return boundaries, results


def describe_failures(results: list[CaseResult]) -> str:
    bad = [r for r in results if r.problem]
    lines = [f"{len(bad)} of {len(results)} crash cases broke an invariant:"]
    lines += [f"- {r.id} ({r.status}): {r.problem}" for r in bad]
    return "\n".join(lines)


# ---------------------------------------------------------------- the report


def counts(boundaries: list[Boundary]) -> str:
    by_kind = collections.Counter(b.kind for b in boundaries)
    return ", ".join(f"{kind} {n}" for kind, n in sorted(by_kind.items()))


def report(enumerated: dict[tuple[str, str], list[Boundary]]) -> str:
    """docs/crash-boundaries.md from {(operation, backend): boundaries}."""
    lines = [
        "# Crash at every write boundary: what the harness covers",
        "",
        "Generated by `ckptlib.testing.harness.crash_run`; do not edit. Regenerate with",
        "",
        f"    {REPORT_COMMAND}",
        "",
        "For each operation and backend the harness records every storage write boundary the",
        "operation performs (local disk: create, write, close, fsync, rename, link, symlink,",
        "delete, mkdir, rmdir, rmtree; S3: put, conditional put, pointer put, delete,",
        "multipart start/part/complete/abort), then runs the operation once more per boundary",
        "and mode in a forked child: **kill** (SIGKILL just before the call) and **fail** (the",
        "call raises what the backend raises: ENOSPC, or S3's AccessDenied). After each case it",
        "checks the invariants (docs/integrity.md; `crash_operations` says how, per operation):",
        "",
        "- the last committed checkpoint loads bit-exactly, and `latest` names a committed step;",
        "- the user's files (planted in the root and in a step directory) are untouched, and",
        "  nothing appears that is neither the user's nor one of ckptlib's own names;",
        "- no lock blocks the next writer (a killed writer's lock is stale: `StaleLockWarning`);",
        "- the next save (export, convert, gc) succeeds and leaves exactly the expected files",
        "  (a killed lock or `latest` move may leave its temporary file, a few bytes);",
        "- a failed operation raised a `CheckpointError` subclass naming the failing path.",
        "",
        "tests/manager/test_crash_boundaries.py runs every case on both backends in the default",
        "run (`pytest -m crash` runs the harness alone). The test also checks that this table matches what the harness",
        'enumerates now. Not covered: the writer process of `async_save(async_mode="process")`',
        "(its writes happen outside the probed process), bytes torch writes from C++ (seen only",
        "as the rename that publishes them), GCS and Azure (the same object-store layer as S3).",
        "",
        "| operation | backend | boundaries | kill cases | fail cases | boundaries by kind |",
        "|---|---|---:|---:|---:|---|",
    ]
    total = 0
    for (name, backend), boundaries in enumerated.items():
        n = len(boundaries)
        total += 2 * n
        lines.append(f"| {name} | {backend} | {n} | {n} | {n} | {counts(boundaries)} |")
    lines += ["", f"{total} cases in all.", ""]
    for (name, backend), boundaries in enumerated.items():
        lines += [f"## {name} on {backend}", ""]
        lines += [f"{b.index}. {b.kind} `{b.path}`" for b in boundaries]
        lines.append("")
    return "\n".join(lines)


def enumerate_all(workdir: str, s3_base: str | None) -> dict[tuple[str, str], list[Boundary]]:
    out = {}
    for operation in OPERATIONS.values():
        for backend in operation.backends:
            if backend == "s3" and s3_base is None:
                continue
            with without_fsync():
                out[(operation.name, backend)] = enumerate_boundaries(operation, backend, workdir, s3_base)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="write the report here (default: print it)")
    parser.add_argument("--run", action="store_true", help="also run every kill and fail case")
    args = parser.parse_args(argv)
    from ckptlib.testing.fakes.s3_server import create_bucket, start_moto_server

    with start_moto_server() as endpoint, tempfile.TemporaryDirectory(prefix="ckptlib-crash-") as workdir:
        s3_base = f"s3://{create_bucket(endpoint)}/run"
        enumerated = enumerate_all(workdir, s3_base)
        text = report(enumerated)
        if args.run:
            started = time.monotonic()
            results = []
            for name, backend in enumerated:
                results += run_operation(OPERATIONS[name], backend, workdir, s3_base)[1]
            print(describe_failures(results), f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
