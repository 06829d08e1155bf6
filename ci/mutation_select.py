"""Per-mutant test selection from a coverage map (standard library only: it runs in cosmic-ray's
test command, ci/mutation_runner.py's client).

The mutated lines are found by comparing each file of the map with its pristine copy (cosmic-ray
writes the mutant into the file before the test command and restores it after). A mutant runs
only the tests whose coverage context reached its statement (in the whole selection's order,
slow tests last); it runs the module's whole selection (the arguments as given) when:

- the map or the pristine copy is missing, or the pristine file is not the one the map measured;
- no file differs, or a changed line is outside every function body (module level, class body,
  decorator, default argument, annotation: run once at import time, which every test depends on);
- a line of the changed statement ran at import time ("<import>" in the map);
- no line of the changed statement ran in-process under any test, and the selection has no test
  that starts processes.

A statement no test ran in-process may still run in spawned rank or CLI processes, which
coverage does not follow: such a mutant runs the selection's spawning tests only (every other
test ran without reaching it, so it runs exactly as unmutated).

With spawning="add", the tests that start processes (ranks, CLI runs; "spawning" in the map) are
added to every in-process selection: those processes run the mutant too, and coverage cannot see
what they execute.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import os

IMPORT_TIME = "<import>"
SLOW_S = 1.0  # tests slower than this run after the others (ranks, CLI runs, sleeps)


def changed_lines(pristine: str, current: str) -> list[int]:
    """1-based line numbers, in the pristine file, of the lines the mutant changed."""
    old, new = pristine.splitlines(), current.splitlines()
    lines: list[int] = []
    for tag, i1, i2, _j1, _j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        # an insertion has i1 == i2: it lies between lines i1 and i1 + 1
        lines.extend(range(i1 + 1, i2 + 1) if i2 > i1 else [max(i1, 1), min(i1 + 1, len(old))])
    return sorted(set(lines))


def _header_span(node: ast.AST) -> tuple[int, int]:
    """The lines of a statement that run as one unit: a simple statement whole, a compound
    statement's header (decorators through the line before its body)."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.AST):
        return start, max(start, body[0].lineno - 1)
    return start, node.end_lineno


def statement_span(tree: ast.AST, line: int) -> tuple[tuple[int, int] | None, bool]:
    """The span of the innermost statement (or except clause) around `line`, and whether the
    line is inside a function body (so it runs when the function is called, not at import)."""
    best = None
    in_function = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            if body[0].lineno <= line <= node.end_lineno:
                in_function = True
        if isinstance(node, (ast.stmt, ast.excepthandler)):
            start, end = _header_span(node)
            if start <= line <= end and (best is None or end - start <= best[1] - best[0]):
                best = (start, end)
    return best, in_function


def select(args: list[str], map_path: str, pristine_dir: str | None, spawning: str = "none") -> tuple[list[str], str]:
    """pytest arguments for this mutant: `args` with its test paths replaced by the covering
    node ids, or `args` unchanged (the module's whole selection) with the reason."""
    try:
        with open(map_path) as f:
            cov = json.load(f)
    except OSError:
        return args, "whole selection: no coverage map"
    changed: dict[str, list[int]] = {}
    sources: dict[str, str] = {}
    for name, digest in cov["sha256"].items():
        try:
            with open(os.path.join(pristine_dir or "", name), "rb") as f:
                pristine = f.read()
            with open(name, "rb") as f:
                current = f.read()
        except OSError:
            return args, f"whole selection: no pristine copy of {name}"
        if hashlib.sha256(pristine).hexdigest() != digest:
            return args, f"whole selection: the coverage map is stale for {name}"
        if pristine != current:
            sources[name] = pristine.decode()
            changed[name] = changed_lines(sources[name], current.decode())
    if not changed:
        return args, "whole selection: no changed line found"
    tests: set[str] = set()
    unreached: list[str] = []  # lines no test ran in-process: their tests are the spawning ones
    for name, lines in changed.items():
        tree = ast.parse(sources[name])
        by_line = cov["lines"].get(name, {})
        for line in lines:
            span, in_function = statement_span(tree, line)
            if span is None or not in_function:
                return args, f"whole selection: {name}:{line} runs at import time"
            covering = set()
            for n in range(span[0], span[1] + 1):
                covering.update(by_line.get(str(n), []))
            if IMPORT_TIME in covering:
                return args, f"whole selection: {name}:{line} ran at import time"
            if not covering:
                if not cov.get("spawning"):
                    return args, f"whole selection: {name}:{line} never ran in-process"
                covering = set(cov["spawning"])
                unreached.append(f"{name}:{line}")
            tests |= covering
    tests.discard("<between tests>")
    if not tests:
        return args, "whole selection: covered only outside tests"
    added = set(cov.get("spawning", [])) - tests if spawning == "add" else set()
    durations = cov.get("durations", {})
    position = {test: n for n, test in enumerate(durations)}  # the order the whole selection runs

    # The covering tests in the whole selection's order (its files fastest first; within a file
    # the targeted unit tests tend to come first, and under `pytest -x` that order stops no later
    # than the whole selection would), tests over a second after the rest, fastest first; then the
    # spawning ones, which under `-x` run only when no covering test killed the mutant.
    # (Sorting every test by its duration put a test that hangs under the mutant, e.g. reading
    # /dev/zero, before a faster-failing unit test: each such mutant then costs the whole timeout.)
    def order(test: str) -> tuple:
        slow = durations.get(test, 1e9) > SLOW_S
        return (slow, durations.get(test, 1e9) if slow else position.get(test, len(position)), test)

    ordered = sorted(tests, key=order) + sorted(added, key=order)
    options = [a for a in args if not a.startswith("tests/")]
    where = ", ".join(f"{name}:{','.join(map(str, lines))}" for name, lines in changed.items())
    why = f"{len(tests)} covering tests (+{len(added)} spawning) for {where}"
    if unreached:
        why += f"; never ran in-process ({', '.join(unreached)}): the spawning tests cover them"
    if added:
        why += "; spawning tests added: " + " ".join(sorted(added))
    return options + ordered, why
