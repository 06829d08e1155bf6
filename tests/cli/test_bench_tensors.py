"""`ckpt bench tensors` at a tiny size, so the tensor-count benchmark cannot rot (no timings asserted)."""

from __future__ import annotations

import json

from helpers.bench_cli import ckpt_bench

from ckptlib.bench import tensor_counts


def test_parameter_shapes_follow_the_transformer_block():
    shapes = tensor_counts.parameter_shapes(20)
    h = tensor_counts.HIDDEN
    assert shapes[:7] == [(h, h)] * 4 + [(2 * h, h), (h, 2 * h), (2 * h, h)]
    assert shapes[7:18] == [(h,)] * 11
    assert shapes[18:] == [(h, h)] * 2  # the next block starts over


def test_bench_tensors_json_to_stdout_with_every_load_bit_exact(tmp_path):
    run = ckpt_bench(
        "tensors", "--tensors", "5", "--world-sizes", "1", "2", "--reps", "1", "--dir", str(tmp_path), "--json"
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    rows = report["summary"]
    assert [(r["tensors"], r["world"]) for r in rows] == [(5, 1), (5, 2)]
    assert all(r["ok"] for r in rows)
    # 5 tensors: two 80x80 weights, their exp_avg, and the first one's exp_avg_sq, float32.
    assert [r["state_mib"] * (1 << 20) for r in rows] == [5 * 80 * 80 * 4] * 2
    for row in report["results"]["rows"]:
        assert sorted(row["times"]) == ["load_ckptlib", "load_dcp", "save_ckptlib", "save_dcp"]
        assert all(len(v) == 1 for v in row["times"].values())
    assert "| ckptlib/DCP |" in run.stderr
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed


def test_bench_tensors_ablation_times_both_collector_settings(tmp_path):
    run = ckpt_bench(
        "tensors", "--tensors", "4", "--world-sizes", "2", "--reps", "1", "--dir", str(tmp_path), "--ablation", "--json"
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    (row,) = report["results"]["rows"]
    assert sorted(row["times"]) == sorted(
        f"{op}_{m}" for op in ("save", "load") for m in ("ckptlib", "dcp", "dcp-gc-paused", "ckptlib-gc-on")
    )
    assert row["ok"]
    (summary,) = report["summary"]
    assert summary["save_dcp-gc-paused_s"] > 0 and summary["load_ckptlib-gc-on_s"] > 0
    assert "| ckptlib / DCP paused |" in run.stderr
