"""`ckpt bench async` at a tiny size, so the async-mode benchmark cannot rot (no timings asserted)."""

from __future__ import annotations

import json

from helpers.bench_cli import ckpt_bench

MODES = ["none", "thread", "process"]


def test_bench_async_json_to_stdout_with_every_mode_and_loads_bit_exact(tmp_path):
    run = ckpt_bench("async", "--quick", "--dir", str(tmp_path), "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    results, summary = report["results"], report["summary"]
    assert results["ok"] and results["process_unavailable"] is None
    assert sorted(results["worlds"]) == ["1", "2"]  # --quick: 1 and 2 ranks
    # every (ranks, loop) cell has the three modes, the ratio of "none" to itself 1.0
    cells = [(row["ranks"], row["loop"], row["mode"]) for row in summary["steps"]]
    assert cells == [(n, loop, mode) for n in (1, 2) for loop in ("cpu", "io") for mode in MODES]
    assert all(row["ratio"] == 1.0 for row in summary["steps"] if row["mode"] == "none")
    for world, runs in results["worlds"].items():
        for rank in runs:
            assert rank["ok"] and rank["shard_bytes"] == 8 << 20, (world, rank["ok"])
            for rep in rank["reps"]:
                for loop in ("cpu", "io"):
                    assert len(rep[loop]["none"]["steps"]) == 10
                    for mode in ("thread", "process"):
                        assert len(rep[loop][mode]["steps"]) >= 5, (loop, mode)
            cap = results["args"]["cap_mib"] << 20
            for row in rank["memory"]:  # the staging high-water mark: the shard, or at most the cap
                limit = rank["shard_bytes"] if row["cap"] is None else cap
                assert 0 < row["staging_peak"] <= limit and (row["cap"] in (None, cap)), row
            assert sorted(rank["first"]) == ["process", "thread"]
    assert [(r["ranks"], r["mode"]) for r in summary["first"]] == [
        (n, m) for n in (1, 2) for m in ("thread", "process")
    ]
    assert "| process |" in run.stderr and "First save from a cold start" in run.stderr
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
