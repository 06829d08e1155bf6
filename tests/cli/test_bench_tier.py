"""`ckpt bench tier` at a tiny size, so the benchmark cannot rot (sources of the bytes and the
report's shape asserted, no timings)."""

from __future__ import annotations

import json

from helpers.bench_cli import ckpt_bench


def test_bench_tier_reports_the_tier_beside_its_baselines(tmp_path):
    run = ckpt_bench("tier", "--quick", "--remote", "dir", "--ranks", "2", "--dir", str(tmp_path), "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] and report["ranks"] == 2 and report["size_mib"] == 8 and report["remote"] == "dir"
    assert report["state_bytes"] == 8 << 20
    summary = report["summary"]
    assert summary["remote_fraction_intact"] == 0 and summary["remote_fraction_node1_lost"] == 0
    assert all(summary[key] > 0 for key in ("blocking_tier_s", "blocking_plain_s", "upload_tier_mib_s"))
    assert set(report["times"]) == {
        "blocking_plain",
        "blocking_tier",
        "upload_tier",
        "upload_sdk",
        "resume_intact",
        "resume_node1_lost",
    }
    for row in ("| save, blocking time |", "| upload, aggregate |", "| resume, node 1 lost, replicas=1 |"):
        assert row in run.stderr
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
