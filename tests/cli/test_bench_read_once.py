"""`ckpt bench read-once` at a tiny size, so the benchmark cannot rot (bytes asserted, no timings)."""

from __future__ import annotations

import json

from helpers.bench_cli import ckpt_bench


def test_bench_read_once_reports_bytes_side_by_side(tmp_path):
    run = ckpt_bench("read-once", "--quick", "--layouts", "ddp", "--world", "2", "--dir", str(tmp_path), "--json")
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(run.stdout)["rows"]
    assert row["layout"] == "ddp" and row["world"] == 2 and row["ok"]
    once, every = row["read-once"], row["every-rank"]
    assert once["needed"] == every["needed"] > 1 << 20
    assert once["storage"] == once["needed"] and once["received"] == once["needed"]  # each rank gets the other half
    assert every["storage"] == 2 * every["needed"] and every["received"] == 0
    default = row["default"]  # a local disk: every rank reads for itself
    assert default["storage"] == every["storage"] and default["received"] == 0
    assert (once["read_once"], every["read_once"], default["read_once"]) == (True, False, False)
    assert "| ddp | 2 | read-once | yes |" in run.stderr and "met (≤ 1.1x needed)" in run.stderr
    assert "| ddp | 2 | default | no |" in run.stderr and "x every-rank's time ≤ 1.15)" in run.stderr
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
