"""`ckpt bench ...` as a user runs it, for the benchmarks' smoke tests: a fresh interpreter in
the repository, stdout (the JSON report) and stderr (the tables) captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ckpt_bench(*argv: str, timeout: float = 280) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", "bench", *argv], capture_output=True, text=True, cwd=REPO, timeout=timeout
    )
