"""Mutation testing of ckptlib's core with cosmic-ray: one session per module, each with the
tests that cover that module, a reduced operator set, and a Markdown list of the survivors.

Run through ci/mutation.sh (it makes the venv with cosmic-ray and the scratch copy of the tree);
docs/mutation.md says what the numbers mean and lists the equivalent survivors.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

#: Module name -> (files cosmic-ray mutates, tests that run for each mutant, first fastest).
#: The tests are the smallest set that covers the module (found by reading which tests call
#: it); `pytest -x` stops at the first failure, so a killed mutant costs a fraction of a run.
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "storage-local": (
        ["ckptlib/storage/local.py"],
        [
            "tests/storage/test_local_storage.py",
            "tests/storage/test_storage_conformance.py",
            "tests/manager/test_crash.py::test_durability_order_of_a_save",
            "tests/format/test_symlinks.py",
            "tests/format/test_special_files.py",
            "-m",
            "not s3 and not gcs and not azure",
        ],
    ),
    "checkpoint": (
        [
            "ckptlib/saving/saving.py",
            "ckptlib/loading/loading.py",
            "ckptlib/loading/load_checks.py",
            "ckptlib/format/write/transaction.py",
        ],
        [
            "tests/api/test_failure_unwrapping.py",
            "tests/api/test_async_single_process.py",
            "tests/api/test_api.py",
            "tests/api/test_load_control.py",
            "tests/api/test_dtype_cast.py",
            "tests/api/test_disk_full.py",
            # the paths only these reach: optimizer hyperparameters a newer torch added, the
            # pre-2.4 key rules (a torch 2.0 checkpoint), trusted=False, a rank lost mid-save
            "tests/format/test_cross_version.py::test_hyperparameter_a_newer_torch_added_keeps_the_optimizers_value",
            "tests/format/test_cross_version.py::test_optimizer_the_checkpoint_lacks_is_still_missing",
            "tests/format/test_legacy.py::test_pre_24_flattened_objects_load",
            "tests/format/test_legacy.py::test_pre_24_flattened_objects_merge_back_every_value",
            "tests/format/test_legacy.py::test_pre_24_keys_still_check_shapes",
            "tests/format/test_integrity.py::test_opaque_object_needs_trusted",
            "tests/api/test_rank_loss.py::test_survivors_of_a_rank_dying_mid_save_raise_rank_lost[save2-victim1]",
            # _agreement: a rank failing between state-dict steps (spawns ranks)
            "tests/api/test_collective_steps.py",
        ],
    ),
    "state": (
        ["ckptlib/state/state.py"],
        [
            "tests/api/test_rank_state.py",
            "tests/api/test_unpicklable_state.py",
            "tests/api/test_api.py",
            # CollectiveSteps: a rank failing between state-dict steps (spawns ranks)
            "tests/api/test_collective_steps.py",
            "tests/elastic/test_training_state.py",
            # a torch 2.0 checkpoint: DCP replaces a nested dict of plain values, _merge_back copies it back
            "tests/format/test_legacy.py::test_pre_24_flattened_objects_load",
            "tests/format/test_legacy.py::test_pre_24_flattened_objects_merge_back_every_value",
            "tests/format/test_legacy.py::test_merge_back_keeps_the_callers_objects",
            # _hyperparameter_keys: an optimizer hyperparameter the checkpoint's torch did not have
            "tests/format/test_cross_version.py::test_hyperparameter_a_newer_torch_added_keeps_the_optimizers_value",
            "tests/format/test_cross_version.py::test_a_param_group_without_its_params_is_missing",
        ],
    ),
    "manager": (
        ["ckptlib/manager/manager.py", "ckptlib/format/native/root.py", "ckptlib/manager/cleanup.py"],
        [
            "tests/manager/test_manager.py",
            "tests/manager/test_fallbacks.py",
            "tests/manager/test_overwrite.py",
            "tests/manager/test_retention.py",
            "tests/manager/test_crash.py",
            # the one-process tests of what only they reach: maybe_save and preemption, the
            # tier= arguments, background_staging's check, initial_load
            "tests/manager/test_save_policy.py::test_step_policies_save_exactly",
            "tests/manager/test_save_policy.py::test_force_and_no_second_save_of_a_step",
            "tests/manager/test_save_policy.py::test_preemption_signal_saves_at_the_next_maybe_save",
            "tests/manager/test_save_policy.py::test_preemption_chains_to_a_python_handler_and_restores_it",
            "tests/manager/test_save_policy.py::test_preemption_after_the_step_was_saved_does_not_save_it_again",
            "tests/manager/test_save_policy.py::test_a_signal_is_handled_once",
            "tests/manager/test_save_policy.py::test_async_maybe_save_waits_for_the_save_in_flight_only_after_a_signal",
            "tests/manager/test_tiered.py::test_constructor_arguments",
            "tests/api/test_async.py::test_background_staging_needs_async",
            "tests/api/test_load_control.py::test_initial_load_model_only_then_ignored_once_the_root_has_a_step",
            "tests/api/test_load_control.py::test_initial_load_with_optimizer_and_after_debris",
            "tests/api/test_load_control.py::test_initial_load_that_does_not_exist",
            "tests/api/test_load_control.py::test_initial_load_needs_modules_or_names",
        ],
    ),
    # The cluster tier the manager holds: node-local roots, per-rank uploads, replicas, resume.
    "tier": (
        [
            "ckptlib/manager/cluster/remote_tier.py",
            "ckptlib/manager/cluster/cluster_tier.py",
            "ckptlib/manager/cluster/resume.py",
            "ckptlib/tiered.py",
        ],
        [
            "tests/manager/test_tiered.py",
            "tests/manager/test_tier_faults.py",
            "tests/manager/test_tier_uploads.py",
            "tests/manager/test_tier_replicas.py",
        ],
    ),
    # S3 is one client under the shared object-store layer: its own modules, with the S3 tests,
    # the conformance suite's S3 cases and the scrubber's.
    "storage-s3": (
        ["ckptlib/storage/s3.py", "ckptlib/storage/s3_client.py"],
        [
            "tests/storage/test_s3_storage.py",
            "tests/storage/test_storage_conformance.py",
            "tests/storage/test_scrub.py",
            "-k",
            "s3 or S3",
        ],
    ),
    # The layer every object store shares (retries, multipart, reads, settings, scrubber), through
    # the conformance suite on all three emulators and the scrubber's tests.
    "storage-objects": (
        [
            "ckptlib/storage/objects.py",
            "ckptlib/storage/prefixed.py",
            "ckptlib/storage/multipart.py",
            "ckptlib/storage/transfer.py",
            "ckptlib/_scrub.py",
        ],
        [
            "tests/storage/test_storage_conformance.py",
            "tests/storage/test_scrub.py",
            "tests/storage/test_s3_storage.py",
        ],
    ),
}
#: format/ is reached through saves, loads, foreign formats, verification and deletion: its
#: selection is wide (the coverage map then picks each mutant's few tests), without the tests
#: whose work happens only in rank or CLI processes.
_FORMAT_TESTS = [
    "tests/format/test_item_encoder.py",
    "tests/format/test_save_planner.py",
    "tests/format/test_safetensors_headers.py",
    "tests/format/test_storage_requests.py",
    "tests/format/test_special_files.py",
    "tests/format/test_symlinks.py",
    "tests/format/test_bounds.py",
    "tests/format/test_plan_costs.py",
    "tests/format/test_integrity.py",
    "tests/format/test_fuzz_formats.py",
    "tests/format/test_blocks.py",
    "tests/format/test_cross_version.py",
    "tests/format/test_damage_kinds.py",
    "tests/format/test_torch_fixtures.py",
    "tests/format/test_export.py",
    "tests/format/test_legacy.py",
    "tests/api/test_api.py",
    "tests/api/test_load_control.py",
    "tests/api/test_dtype_cast.py",
    "tests/api/test_disk_full.py",
    "tests/storage/test_local_storage.py",
    "tests/manager/test_steps.py",
    "tests/manager/test_overwrite.py",
    "tests/manager/test_manager.py",
    "tests/manager/test_retention.py",
    "tests/cli/test_cli.py",
]
_FORMAT_FILES = [
    f"ckptlib/format/{path.name}"
    for path in sorted(Path(__file__).resolve().parent.parent.joinpath("ckptlib", "format").glob("*.py"))
    if path.name != "__init__.py"
]
#: The whole of format/ in one session: ~2,850 kept mutants, so run as a random sample (MUTATION_SAMPLE).
MODULES["format"] = (_FORMAT_FILES, _FORMAT_TESTS)
for _file in _FORMAT_FILES:
    MODULES["format-" + Path(_file).stem] = ([_file], _FORMAT_TESTS)

#: The operators kept: one replacement per operator site (the boundary or the opposite), not
#: the full cross product, which is 10-12 mutants per `+` or `==` and mostly redundant.
KEPT_OPERATORS = re.compile(
    r"core/("
    r"ReplaceBinaryOperator_(Add_Sub|Sub_Add|Mult_Add|Div_Mult|FloorDiv_Mult|Mod_FloorDiv|Pow_Mult"
    r"|LShift_RShift|RShift_LShift|BitOr_BitAnd|BitAnd_BitOr|BitXor_BitOr)"
    r"|ReplaceComparisonOperator_(Eq_NotEq|NotEq_Eq|Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Is_IsNot|IsNot_Is)"
    r"|ReplaceUnaryOperator_(USub_UAdd|Delete_Not|Invert_USub)"
    r"|AddNot|ReplaceTrueWithFalse|ReplaceFalseWithTrue|ReplaceAndWithOr|ReplaceOrWithAnd"
    r"|ZeroIterationForLoop|ExceptionReplacer|ReplaceBreakWithContinue|ReplaceContinueWithBreak"
    r"|NumberReplacer|RemoveDecorator)$"
)


def _skipped_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Source spans no test can observe: annotations (strings at runtime under
    `from __future__ import annotations`) and `if TYPE_CHECKING:` blocks."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        annotations = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    annotations.append(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            annotations.extend(node.body)
        for ann in annotations:
            if ann is not None:
                spans.append(((ann.lineno, ann.col_offset), (ann.end_lineno, ann.end_col_offset)))
    return spans


def _inside(pos, spans) -> bool:
    return any(start <= pos <= end for start, end in spans)


#: MUTATION_SAMPLE=N keeps a random sample of N of the kept mutants at `init` (seeded by
#: MUTATION_SEED, default 0, so a session can be rebuilt); the rest are skipped as "not sampled".
SAMPLE = int(os.environ.get("MUTATION_SAMPLE", "0"))
SEED = int(os.environ.get("MUTATION_SEED", "0"))
NOT_SAMPLED = "not sampled"


def _filter(session: Path) -> tuple[int, int]:
    """Mark the work items outside the kept operators, or inside annotations, as skipped (and,
    with MUTATION_SAMPLE, all but a random sample of the kept ones)."""
    import random

    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    kept = dropped = 0
    kept_ids = []
    spans_by_file: dict[str, list] = {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            mutation = item.mutations[0]
            path = str(mutation.module_path)
            if path not in spans_by_file:
                spans_by_file[path] = _skipped_spans(Path(path).read_text())
            start = tuple(mutation.start_pos)
            # cosmic-ray positions are 1-based lines, 0-based columns, like ast's.
            if KEPT_OPERATORS.match(mutation.operator_name) and not _inside(start, spans_by_file[path]):
                kept += 1
                # job ids are random per `init`: sample by the mutant itself, so a seed rebuilds it
                kept_ids.append(
                    ((path, tuple(mutation.start_pos), mutation.operator_name, mutation.occurrence), item.job_id)
                )
                continue
            dropped += 1
            db.set_result(item.job_id, WorkResult(output="filtered", worker_outcome=WorkerOutcome.SKIPPED))
        if 0 < SAMPLE < kept:
            sampled = {job_id for _, job_id in random.Random(SEED).sample(sorted(kept_ids), SAMPLE)}
            for _, job_id in kept_ids:
                if job_id not in sampled:
                    db.set_result(job_id, WorkResult(output=NOT_SAMPLED, worker_outcome=WorkerOutcome.SKIPPED))
            print(
                f"{session.stem}: a random sample of {SAMPLE} of the {kept} kept mutants (MUTATION_SEED={SEED})",
                flush=True,
            )
    return kept, dropped


def _config(module: str, test_command: str, timeout: float) -> str:
    return (
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(MODULES[module][0])}\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test_command)}\n"
        "[cosmic-ray.distributor]\n"
        'name = "local"\n'
    )


def _cr(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", *args], check=True)


def _start_runner(python: str, out: Path) -> tuple[subprocess.Popen, str]:
    """The warm pytest server (ci/mutation_runner.py) on a socket under out/."""
    sock = str(out / f"{os.getpid()}.sock")
    server = subprocess.Popen([python, "ci/mutation_runner.py", "serve", sock], stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    if not line.startswith("ready"):
        sys.exit(f"the warm pytest server did not start: {line!r}")
    return server, sock


#: Whether a mutant whose lines ran in-process also runs the selection's tests that start
#: processes (ranks, CLI runs), whose coverage is not measured: "add" or "none" (docs/mutation.md).
SPAWNING = os.environ.get("MUTATION_SPAWNING", "none")


def coverage(module: str, python: str, out: Path) -> None:
    """Run the module's selection once under coverage.py, one context per test, and write
    out/<module>.coverage.json: {"lines": {file: {line: [node ids, "<import>"]}}, ...}."""
    out.mkdir(parents=True, exist_ok=True)
    paths, tests = MODULES[module]
    target = out / f"{module}.coverage.json"
    started = time.monotonic()
    result = subprocess.run(
        [
            python,
            "ci/mutation_runner.py",
            "coverage",
            str(target),
            *paths,
            "--",
            "-q",
            "-p",
            "no:cacheprovider",
            "--timeout",
            "120",
            *tests,
        ]
    )
    if result.returncode != 0:
        target.unlink(missing_ok=True)
        sys.exit(f"{module}: the unmutated tests fail under coverage, no map written")
    cov = json.loads(target.read_text())
    cov["tests_sha256"] = _tests_digest()
    target.write_text(json.dumps(cov, indent=0))
    for path in paths:
        by_line = cov["lines"].get(path, {})
        import_only = sum(1 for ids in by_line.values() if ids == ["<import>"])
        print(f"{path}: {len(by_line)} lines ran, {import_only} only at import time", flush=True)
    print(
        f"{module}: {len(cov['durations'])} tests ({len(cov['spawning'])} start processes), "
        f"{time.monotonic() - started:.0f} s -> {target}",
        flush=True,
    )


def _tests_digest() -> str:
    """One digest of every file under tests/ and of the module table: a map made before a test
    was added or changed (`retest` after new tests) would not select the new test."""
    import hashlib

    digest = hashlib.sha256(json.dumps(MODULES, sort_keys=True).encode())
    for path in sorted(Path("tests").rglob("*.py")):
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _selection(module: str, out: Path) -> list[str]:
    """The per-mutant options of ci/mutation_runner.py's client: the coverage map when there is
    one for the module's current files (and a pristine copy of them to find the mutated lines)."""
    import hashlib
    import shutil

    target = out / f"{module}.coverage.json"
    if not target.exists():
        print(f"{module}: no coverage map, every mutant runs the whole selection", flush=True)
        return []
    cov = json.loads(target.read_text())
    if cov.get("tests_sha256") != _tests_digest():
        print(
            f"{module}: the coverage map predates the current tests (run `coverage` again); "
            "every mutant runs the whole selection",
            flush=True,
        )
        return []
    digests = cov["sha256"]
    pristine = out / f"{module}.pristine"
    for path in MODULES[module][0]:
        if hashlib.sha256(Path(path).read_bytes()).hexdigest() != digests.get(path):
            print(
                f"{module}: the coverage map is stale for {path} (run `coverage` again); "
                "every mutant runs the whole selection",
                flush=True,
            )
            return []
        (pristine / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, pristine / path)
    print(f"{module}: per-mutant tests from {target} (spawning tests: {SPAWNING})", flush=True)
    return ["--map", str(target), "--pristine", str(pristine), "--spawning", SPAWNING]


def run(module: str, python: str, out: Path) -> None:
    """Init (once), filter, time the baseline, execute the pending mutants, write the report."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{module}.toml"
    session = out / f"{module}.sqlite"
    _, tests = MODULES[module]
    selection = _selection(module, out)
    server, sock = _start_runner(python, out)
    try:
        pytest_args = ["-x", "-q", "-p", "no:cacheprovider", "--timeout", "120", *tests]
        baseline_start = time.monotonic()
        baseline = subprocess.run(
            [sys.executable, "ci/mutation_runner.py", "test", sock, "3600", "--", *pytest_args],
            capture_output=True,
            text=True,
        )
        baseline_s = time.monotonic() - baseline_start
        if baseline.returncode != 0:
            sys.exit(f"{module}: the unmutated tests fail, no mutation run:\n{baseline.stdout[-3000:]}")
        # A mutant whose tests run 3x longer than unmutated (plus slack for a loaded machine)
        # counts as killed by timeout: an infinite loop is a behaviour change.
        timeout = round(3 * baseline_s + 60)
        command = [sys.executable, "ci/mutation_runner.py", "test", sock, str(timeout), *selection, "--", *pytest_args]
        config.write_text(_config(module, shlex.join(command), timeout=timeout + 30))
        if not session.exists():
            _cr("init", str(config), str(session))
            kept, dropped = _filter(session)
            print(f"{module}: {kept} mutants kept, {dropped} filtered", flush=True)
        print(f"{module}: baseline {baseline_s:.0f} s", flush=True)
        started = time.monotonic()
        _cr("exec", str(config), str(session))
        print(f"{module}: exec took {time.monotonic() - started:.0f} s", flush=True)
    finally:
        server.kill()
        server.wait()
    report(module, out)


def _diff(mutation, tree: Path) -> str:
    """The mutant's diff, rebuilt by applying the operator to the file (cosmic-ray stores none
    for survivors when run with the local distributor)."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    path = tree / mutation.module_path
    code = path.read_text()
    operator = get_operator(mutation.operator_name)(**mutation.operator_args)
    mutated = mutate_code(code, operator, mutation.occurrence)
    if mutated is None:
        return ""
    return "".join(difflib.unified_diff(code.splitlines(True), mutated.splitlines(True), n=0))


#: Verdicts on survivors, keyed "path:line:operator" (or "...#occurrence" where one line has
#: two mutants of one operator): "equivalent: why" or "killed by: test".
VERDICTS_FILE = Path(__file__).with_name("mutation_verdicts.json")


def report(module: str, out: Path) -> dict:
    """Counts per outcome and a Markdown list of surviving mutants (out/<module>.md), each with
    its verdict from ci/mutation_verdicts.json when there is one."""
    verdicts = json.loads(VERDICTS_FILE.read_text()) if VERDICTS_FILE.exists() else {}
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    session = out / f"{module}.sqlite"
    counts = {"killed": 0, "survived": 0, "timeout": 0, "incompetent": 0, "pending": 0, "skipped": 0, NOT_SAMPLED: 0}
    survivors = []
    sites = set()  # "path:line:operator" of every mutant in the session, for stale verdicts
    with use_db(str(session), WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in db.work_items:
            mutation = item.mutations[0]
            sites.add(f"{mutation.module_path}:{mutation.start_pos[0]}:{mutation.operator_name}")
            result = results.get(item.job_id)
            if result is None:
                counts["pending"] += 1
            elif result.worker_outcome == WorkerOutcome.SKIPPED:
                counts[NOT_SAMPLED if result.output == NOT_SAMPLED else "skipped"] += 1
            elif result.worker_outcome == WorkerOutcome.ABNORMAL:
                counts["timeout"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                survivors.append(item)
            elif result.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            else:
                counts["killed"] += 1
    equivalent = 0
    body = []
    for item in sorted(survivors, key=lambda i: tuple(i.mutations[0].start_pos)):
        mutation = item.mutations[0]
        key = f"{mutation.module_path}:{mutation.start_pos[0]}:{mutation.operator_name}"
        verdict = verdicts.get(f"{key}#{mutation.occurrence}", verdicts.get(key, ""))
        equivalent += verdict.startswith("equivalent")
        body += [
            f"## {item.job_id[:8]} {mutation.module_path}:{mutation.start_pos[0]} {mutation.operator_name}"
            f" (in {mutation.definition_name})",
            "",
            "```diff",
            _diff(mutation, Path.cwd()).rstrip(),
            "```",
            "",
            f"Verdict: {verdict or 'not judged yet'}",
            "",
        ]
    counts["equivalent"] = equivalent
    ran = counts["killed"] + counts["timeout"] + counts["survived"]  # incompetent: the tests could not run
    score = f"{counts['killed'] + counts['timeout']} / {ran - equivalent}" if ran > equivalent else "n/a"
    if counts[NOT_SAMPLED] and ran > equivalent:
        low, high = _wilson(counts["killed"] + counts["timeout"], ran - equivalent)
        score += f" (a random sample: the module's score lies in {low:.1%}-{high:.1%} with 95% confidence)"
    # Verdicts are keyed by line: an edit above a verdict's line moves its mutant away from it.
    stale = sorted(
        key
        for key in verdicts
        if key.startswith(tuple(f"{p}:" for p in MODULES[module][0])) and key.split("#")[0] not in sites
    )
    if stale:
        body += [
            "## Stale verdicts (no mutant of that operator on that line any more: re-key them)",
            "",
            *[f"- `{key}`" for key in stale],
            "",
        ]
        print(f"{module}: {len(stale)} verdicts match no mutant (see {module}.md)", flush=True)
    lines = [
        f"# Surviving mutants: {module}",
        "",
        f"Counts: {json.dumps(counts)}",
        f"Score (killed / non-equivalent run): {score}",
        "",
        *body,
    ]
    (out / f"{module}.md").write_text("\n".join(lines))
    print(f"{module}: {json.dumps(counts)}", flush=True)
    return counts


def _wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion measured on a random sample."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def retest(module: str, out: Path) -> None:
    """Drop the results of the surviving mutants, so the next `run` executes them again."""
    import sqlite3

    with sqlite3.connect(out / f"{module}.sqlite") as db:
        cursor = db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
        print(f"{module}: {cursor.rowcount} survivors pending again", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command",
        choices=["run", "report", "retest", "list", "coverage"],
        help="run: init (once) and execute the pending mutants, each with the tests that "
        "cover its lines when `coverage` made a map for the module (else the whole "
        "selection); report: counts and survivors; retest: make the survivors pending "
        "again (after new tests); coverage: run the selection once under coverage.py "
        "and write <out>/<module>.coverage.json",
    )
    parser.add_argument("modules", nargs="*", help="names from `list` (default: all)")
    parser.add_argument(
        "--python",
        default=os.environ.get("MUTATION_TEST_PYTHON", sys.executable),
        help="the interpreter that runs the tests (has torch and the test extra)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("MUTATION_OUT", "mutation-out")),
        help="where the sessions (.sqlite) and survivor reports (.md) go",
    )
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, (paths, tests) in MODULES.items():
            has_map = (args.out / f"{name}.coverage.json").exists()
            per_mutant = "covering tests (coverage map)" if has_map else "whole selection (no coverage map)"
            print(f"{name}: {' '.join(paths)} <- {' '.join(tests)}  [per mutant: {per_mutant}]")
        return
    for module in args.modules or list(MODULES):
        if module not in MODULES:
            sys.exit(f"unknown module {module!r}; see `list`")
        if args.command == "run":
            run(module, args.python, args.out.resolve())
        elif args.command == "coverage":
            coverage(module, args.python, args.out.resolve())
        elif args.command == "retest":
            retest(module, args.out.resolve())
        else:
            report(module, args.out.resolve())


if __name__ == "__main__":
    main()
