"""`ckpt bench`'s command line: JSON to stdout, and what a plain install depends on."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--sizes", "1", "--world-sizes", "1", "--reps", "1", "--warm-only",
        "--no-s3", "--no-rss", "--no-reshard", "--no-async"]


def test_bench_json_without_a_file_goes_to_stdout_alone(tmp_path):
    """`--json` with no file writes the report to stdout (like `ckpt inspect --json`); the
    tables go to stderr so stdout parses as one JSON document."""
    run = subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", "bench", *TINY, "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=280,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert set(report) == {"results", "summary", "targets"}
    assert report["results"]["command"].endswith("--json")
    assert "Wall time of the benchmark" in run.stderr


def test_a_plain_install_gets_the_fast_crc():
    """The single-pass encoder and block checksums need zlib-ng: a dependency, not an extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "zlib-ng" for dep in project["dependencies"])
    from ckptlib.format import checksum

    assert checksum.FAST
