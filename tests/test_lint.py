"""The repository is formatted and linted by ruff, configured in pyproject.toml ([tool.ruff]):
`ruff format` and `ruff check` run here, so a change that is not formatted or lints badly fails
the suite, not a separate CI step. vulture runs here too: ckptlib/ holds no dead code (names
only torch, pickle, pytest... call are listed in tests/helpers/vulture_whitelist.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "ruff")
    if os.path.exists(beside):
        return [beside]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs it")
    return [found]


@pytest.mark.parametrize(
    "command",
    [["format", "--check", "--diff"], ["check", "--no-fix", "--output-format", "concise"]],
    ids=["format", "check"],
)
def test_ruff(command):
    done = subprocess.run([*_ruff(), *command, REPO], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff {command[0]} found problems:\n{done.stdout}{done.stderr}"


#: vulture's confidence for an unused function, class, method, attribute or variable (60%):
#: above it only unused imports, arguments and unreachable code would be reported.
DEAD_CODE_CONFIDENCE = 60
#: Where ckptlib's names are used besides the package itself: its tests, benchmarks, examples
#: and CI scripts (a public name users call and the tests exercise is not dead).
USED_FROM = ("tests", "benchmarks", "examples", "ci", "conftest.py")


def dead_code(package: str, used_from: list[str], ignore_names: tuple[str, ...] = ()) -> list:
    """vulture's findings (name, typ, filename, first_lineno...) in what `package` defines and
    nothing in `used_from` uses."""
    try:
        import vulture
    except ImportError:
        pytest.fail("vulture is not installed: pip install -e '.[test]' installs it")
    checker = vulture.Vulture(ignore_names=list(ignore_names))
    checker.scavenge([package, *used_from])
    package = os.path.abspath(package)
    return [
        item
        for item in checker.get_unused_code(min_confidence=DEAD_CODE_CONFIDENCE)
        if os.path.abspath(item.filename).startswith(package + os.sep)
    ]


def test_no_dead_code():
    from helpers.vulture_whitelist import WHITELIST

    found = dead_code(os.path.join(REPO, "ckptlib"), [os.path.join(REPO, p) for p in USED_FROM], WHITELIST)
    assert not found, (
        "unused code in ckptlib/ (delete it; a name only torch, pickle, pytest... calls goes in "
        "tests/helpers/vulture_whitelist.py):\n" + "\n".join(item.get_report() for item in found)
    )


def test_dead_code_check_finds_an_unused_function(tmp_path):
    """The check is not vacuous: a function nothing calls is reported, one that is called is
    not, and the whitelist does not hide it."""
    from helpers.vulture_whitelist import WHITELIST

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("def used():\n    return 1\n\n\ndef forgotten():\n    return 2\n")
    caller = tmp_path / "caller.py"
    caller.write_text("from pkg.mod import used\n\nprint(used())\n")
    found = dead_code(str(package), [str(caller)], WHITELIST)
    assert [(item.typ, item.name, os.path.basename(item.filename), item.first_lineno) for item in found] == [
        ("function", "forgotten", "mod.py", 5)
    ]
