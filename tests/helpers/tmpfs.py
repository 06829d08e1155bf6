"""A small tmpfs for disk-full tests: mounting needs root (CI runs as root); elsewhere the test
is skipped with the reason."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def small_tmpfs(where: str, size: str = "1m") -> Iterator[str]:
    """Mount a tmpfs of `size` at the new directory `where`; unmounted afterwards."""
    os.makedirs(where, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=30)
