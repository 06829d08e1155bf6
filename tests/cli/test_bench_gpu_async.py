"""`python -m ckptlib.bench.gpu_async`: the GPU async-save benchmark's dry run on the CPU runs
every method through the GPU run's code path and verifies its checkpoints bit-exact, and without
CUDA the default (GPU) run refuses with exit status 2 instead of printing numbers. No timings
are asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
METHODS = ["none", "thread", "process", "process_bg", "dcp_process_pinned"]
SAVE_FIELDS = {"steps", "blocking", "call", "wait_staged", "commit", "problems"}


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptlib.bench.gpu_async", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )


def test_cpu_dry_run_runs_every_method_and_verifies_each_checkpoint(tmp_path):
    out = tmp_path / "gpu-async.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = ("--device", "cpu", "--mib", "4", "--reps", "1", "--steps", "3", "--dir", str(scratch), "--json", str(out))
    run = _bench(*argv)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    results, summary = report["results"], report["summary"]
    assert [row["method"] for row in summary] == METHODS
    assert results["ok"] and results["state_bytes"] == 4 << 20 and results["args"]["device"] == "cpu"
    (rep,) = results["reps"]
    assert rep["order"] == METHODS and set(rep["runs"]) == set(METHODS)
    assert len(rep["runs"]["none"]["steps"]) == 3
    for method in METHODS[1:]:
        runs = rep["runs"][method]
        assert set(runs) == SAVE_FIELDS and runs["problems"] == [] and len(runs["steps"]) >= 3
        assert 0 < runs["call"] <= runs["blocking"] and runs["commit"] > 0
    for row in summary:
        assert row["bit_exact"] is (None if row["method"] == "none" else True)
        assert (row["blocking_s_per_gb"] is None) == (row["method"] == "none") and row["slowdown"] > 0
    assert summary[0]["slowdown"] == 1.0
    assert results["dcp_staging_options"] == {
        "use_pinned_memory": False,
        "use_shared_memory": True,
        "use_async_staging": False,
        "use_non_blocking_copy": False,
    }
    assert "| dcp_process_pinned |" in run.stdout and "Dry run on the CPU" in run.stdout
    assert list(scratch.iterdir()) == []  # every checkpoint and the scratch directory are removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the GPU run would start")
def test_without_cuda_the_gpu_run_exits_2_and_measures_nothing(tmp_path):
    out = tmp_path / "never.json"
    run = _bench("--mib", "4", "--json", str(out))
    assert run.returncode == 2
    assert "CUDA is not available" in run.stderr and "--device cpu" in run.stderr
    assert run.stdout == "" and not out.exists()
