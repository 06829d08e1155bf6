"""How the test suite shares code (issue 29): fixtures come from the plugin (ckptlib.testing.plugin)
or a conftest.py, never imported by name into a test module; helpers shared by test modules live in
tests/helpers/; no test module imports another (also not in the scripts it runs in a subprocess)."""

from __future__ import annotations

import ast
import os
import re

import pytest

from ckptlib.testing.fakes import fixtures as fake_fixtures

TESTS = os.path.dirname(os.path.abspath(__file__))
SKIPPED_DIRS = {"fixtures", "__pycache__"}  # fixtures/: the golden checkpoints and their generator
PLUGIN_FIXTURES = set(fake_fixtures.__all__) | {"dist_run"}
# an import line of a test module or conftest, also inside a string (a child process's script)
_TEST_IMPORT = re.compile(r"^\s*(?:from|import)\s+(?:test_\w+|tests|conftest)\b", re.MULTILINE)


def _python_files() -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(TESTS):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        found += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return found


def _rel(path: str) -> str:
    return os.path.relpath(path, os.path.dirname(TESTS)).replace(os.sep, "/")


def problems(source: str) -> list[str]:
    """What in `source` (a file of the suite) breaks the rules above."""
    found = [
        f"line {source.count(chr(10), 0, m.start()) + 1}: {m.group().strip()}" for m in _TEST_IMPORT.finditer(source)
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            fixtures = sorted(alias.name for alias in node.names if alias.name in PLUGIN_FIXTURES)
            if fixtures:
                found.append(f"line {node.lineno}: fixtures imported by name from {node.module}: {fixtures}")
    return found


FILES = _python_files()


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_no_test_module_imports_another_or_a_fixture(path):
    with open(path) as f:
        assert problems(f.read()) == [], _rel(path)


def test_only_tests_and_conftests_outside_helpers():
    helpers = os.path.join(TESTS, "helpers") + os.sep
    strays = [
        _rel(p)
        for p in FILES
        if not p.startswith(helpers) and not re.fullmatch(r"test_\w+\.py|conftest\.py", os.path.basename(p))
    ]
    assert strays == [], "helpers shared by test modules belong in tests/helpers/"


def test_the_rules_are_not_vacuous():
    child = 'SCRIPT = """\nimport sys\nfrom test_tiered import _state\n"""\n'
    assert problems(child) == ["line 3: from test_tiered"]
    assert problems("from ckptlib.testing.fakes.s3_server import moto_server, s3_env\n") == [
        "line 1: fixtures imported by name from ckptlib.testing.fakes.s3_server: ['moto_server']"
    ]
    assert problems("import tests.helpers\nfrom helpers.golden import diff\n") == ["line 1: import tests"]
    assert any(_rel(p) == "tests/helpers/golden.py" for p in FILES)


def test_no_two_test_modules_share_a_file_name():
    """tests/ has no __init__.py files, so pytest imports each test module by its file name: two
    test_x.py in different rooms make the whole run fail to collect."""
    rooms: dict[str, list[str]] = {}
    for path in FILES:
        name = os.path.basename(path)
        if name.startswith("test_"):
            rooms.setdefault(name, []).append(_rel(path))
    assert {name: paths for name, paths in rooms.items() if len(paths) > 1} == {}
