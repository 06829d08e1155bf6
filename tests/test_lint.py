"""The repository is formatted and linted by ruff, configured in pyproject.toml ([tool.ruff]):
`ruff format` and `ruff check` run here, so a change that is not formatted or lints badly fails
the suite, not a separate CI step."""

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
