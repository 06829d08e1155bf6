"""Crash at every write boundary (issue 26): for each operation of the harness's registry
(`ckptlib.testing.harness.crash_operations`) on local disk and on S3 (moto), every storage write
boundary is found, then the operation is killed there (SIGKILL) and made to fail there (ENOSPC,
S3 AccessDenied), each in a forked child; the invariants are checked after every case (the
last committed checkpoint loads bit-exactly, `latest` names a committed step, the user's files
are untouched, no lock blocks the next writer, the next save succeeds, a failure is a named
CheckpointError). docs/crash-boundaries.md is the report of what is covered; it must match.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

import ckptlib
from ckptlib.testing.harness.crash_operations import OPERATIONS, Operation
from ckptlib.testing.harness.crash_points import Watch, run_case
from ckptlib.testing.harness.crash_run import REPORT_COMMAND, describe_failures, enumerate_all, report, run_operation
from ckptlib.testing.harness.crash_scene import Scene, state

REPORT = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "crash-boundaries.md")
CASES = [(name, backend) for name, op in OPERATIONS.items() for backend in op.backends]


def _s3_base(request, backend: str) -> str | None:
    return request.getfixturevalue("s3_root") if backend == "s3" else None


def _case(name: str, backend: str):
    """Every enumeration runs in the default run (S3's take a few minutes in all: moto answers
    each request in ~20 ms); `pytest -m crash` runs the harness alone."""
    return pytest.param(name, backend, marks=[pytest.mark.crash], id=f"{name}-{backend}")


@pytest.mark.parametrize("name, backend", [_case(*case) for case in CASES])
def test_crash_at_every_write_boundary(request, tmp_path, name, backend):
    boundaries, results = run_operation(OPERATIONS[name], backend, str(tmp_path), _s3_base(request, backend))
    assert boundaries and len(results) == 2 * len(boundaries)
    assert {r.status for r in results if r.mode == "kill"} == {"killed"}
    assert not [r for r in results if r.problem], describe_failures(results)


def test_the_report_matches_what_the_harness_enumerates(tmp_path, s3_root):
    with open(REPORT, encoding="utf-8") as f:
        committed = f.read()
    now = report(enumerate_all(str(tmp_path), s3_root))
    assert committed == now, f"docs/crash-boundaries.md is stale: regenerate it with `{REPORT_COMMAND}`"
    assert {(name, backend) for name, backend in CASES} == {
        tuple(line.split(" | ")[:2]) for line in (row.strip("| ") for row in committed.splitlines()) if " | " in line
    } - {("operation", "backend"), ("---", "---")}


# ---------------------------------------------------------------- the harness itself can fail


def _prepare(scene: Scene) -> None:
    scene.plant("notes.txt")


def _act_careless(scene: Scene) -> None:
    try:
        ckptlib.save(scene.uri("ck"), state(1))
    except ckptlib.CheckpointError:
        shutil.rmtree(scene.root)  # a cleanup that removes what no ckptlib operation may remove
        raise


def _check_user_files(scene: Scene, outcome) -> None:
    scene.assert_user_files()


def test_a_broken_operation_is_reported_case_by_case(tmp_path):
    careless = Operation("careless", ("local",), _prepare, _act_careless, _check_user_files)
    boundaries, results = run_operation(careless, "local", str(tmp_path))
    assert [b.kind for b in boundaries[:2]] == ["mkdir", "create"] and len(results) == 2 * len(boundaries)
    assert [r.problem for r in results if r.mode == "kill"] == [""] * len(boundaries)
    fails = [r for r in results if r.mode == "fail"]
    assert all(r.status == "raised" and "notes.txt was changed or removed" in r.problem for r in fails)
    assert describe_failures(results).startswith(f"{len(boundaries)} of {len(results)} crash cases broke an invariant")


def test_a_hanging_child_is_killed_and_reported(tmp_path):
    started = time.monotonic()
    outcome = run_case(lambda: time.sleep(60), Watch(local=str(tmp_path)), timeout=1.0)
    assert outcome.status == "hung" and time.monotonic() - started < 30


def test_a_fail_case_raises_what_the_disk_raises(tmp_path):
    target = str(tmp_path / "ck")
    outcome = run_case(lambda: ckptlib.save(target, state(1)), Watch(local=str(tmp_path)), "fail", 0)
    assert outcome.status == "raised" and outcome.boundaries[0].kind == "mkdir"
    assert outcome.error_type == "StorageError" and outcome.error_path == target
    assert "No space left on device (injected)" in outcome.error_message
