"""`ckpt bench async` at a tiny size, so the async-mode benchmark cannot rot (no timings asserted)."""

from __future__ import annotations

import json

from helpers.bench_cli import ckpt_bench


def test_bench_async_json_to_stdout_with_every_mode_and_loads_bit_exact(tmp_path):
    run = ckpt_bench("async", "--quick", "--reps", "3", "--dir", str(tmp_path), "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert [row["mode"] for row in report["summary"]] == ["none", "thread", "process"]
    reps = report["results"]["reps"]
    # interleaved: each repetition starts with the next mode
    assert [rep["order"] for rep in reps] == [["none", "thread", "process"], ["thread", "process", "none"]]
    for rep in reps:
        assert len(rep["runs"]["none"]["steps"]) == 10
        for mode in ("thread", "process"):
            run_ = rep["runs"][mode]
            assert len(run_["steps"]) >= 5 and 0 < run_["blocking"] <= run_["save"]
    assert report["results"]["ok"] and not report["results"]["process_fallback"]
    assert report["summary"][0]["ratio"] == 1.0
    assert "| process |" in run.stderr and "First save" in run.stderr
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
