"""`ckpt bench`'s command line: JSON to stdout, and what a plain install depends on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tomllib
from helpers.bench_cli import ckpt_bench

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--sizes",
    "1",
    "--world-sizes",
    "1",
    "--reps",
    "1",
    "--warm-only",
    "--no-s3",
    "--no-rss",
    "--no-reshard",
    "--no-async",
]


def test_bench_json_without_a_file_goes_to_stdout_alone(tmp_path):
    """`--json` with no file writes the report to stdout (like `ckpt inspect --json`); the
    tables go to stderr so stdout parses as one JSON document."""
    run = ckpt_bench(*TINY, "--dir", str(tmp_path), "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert set(report) == {"results", "summary", "targets"}
    assert report["results"]["command"].endswith("--json")
    assert "Wall time of the benchmark" in run.stderr


def test_a_plain_install_gets_the_fast_crc():
    """The single-pass encoder and block checksums need zlib-ng: a dependency, not an extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "zlib-ng" for dep in project["dependencies"])
    from ckptlib.format.items import checksum

    assert checksum.FAST


def test_bench_keeps_what_c_code_and_ranks_print_to_fd_1_off_stdout():
    """`ckpt bench` points fd 1 at stderr while sys.stdout still reaches the real stdout: gloo's
    C++ side prints "[Gloo] Rank ... connected" to fd 1 in the rank processes on some torch
    versions (2.9, 2.10), which made `ckpt bench --json`'s stdout unparsable there. Checked
    here without gloo: a raw write to fd 1 and a child process that inherits it."""
    code = (
        "import os, subprocess, sys\n"
        "from ckptlib.cli import report_stdout\n"
        "with report_stdout():\n"
        "    os.write(1, b'raw fd 1 noise\\n')\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"child noise\")'], check=True)\n"
        "    print('{\"report\": 1}')\n"
        "print('after')\n"
        "os.write(1, b'fd 1 again\\n')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == '{"report": 1}\nafter\nfd 1 again\n'
    assert "raw fd 1 noise" in run.stderr and "child noise" in run.stderr


def test_the_benchmarks_ship_in_the_wheel():
    """`ckpt bench` runs from any install: its code is a subpackage the wheel's package list
    takes (pyproject's packages.find), and no benchmark Python is left outside the package."""
    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=config["include"])
    assert {"ckptlib.bench", "ckptlib.cli"} <= set(packages)
    assert not [p for p in (ROOT / "benchmarks").rglob("*.py")]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["ckpt"] == "ckptlib.cli:main"


def test_bench_runs_outside_the_source_tree(tmp_path):
    """No sys.path trick or path relative to the checkout: `ckpt bench scale` from another
    working directory, with the interpreter's own path only."""
    run = subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", "bench", "scale", "--worlds", "2", "--tensors", "3", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    (row,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert (row["world"], row["tensors"], row["chunks"], row["rank_reads"]) == (2, 3, 6, 3)
