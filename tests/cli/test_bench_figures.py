"""Every figure `ckpt bench` prints is in range, and every count takes its number's noun.

Before: the load table printed a checksum share of -30.0% (a share computed as (with - without)
/ with from noisy timings: the run in benchmarks/results/ceilings.json), and reports read
"64 MiB, 1 ranks", "over 1 process(es)", "1 repetitions".
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from ckptlib.bench import counted
from ckptlib.bench.ceiling_summary import markdown_ceilings
from ckptlib.bench.throughput_summary import markdown, summarize, verify_share

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "ceilings.json"


def test_verify_share_is_clamped_at_zero_and_keeps_what_was_measured():
    assert verify_share(1.0, 0.75) == (0.25, 0.25)
    share, measured = verify_share(1.0, 1.25)
    assert (share, measured) == (0.0, -0.25)
    assert all(math.isnan(x) for x in verify_share(None, 1.0) + verify_share(1.0, 0.0))


def test_a_noisy_run_prints_no_negative_share_and_says_why():
    results = json.loads(RUN.read_text())["results"]
    summary = summarize(results)
    cold = {(r["size_mib"], r["world"]): r for r in summary["load"]}[(256, 4)]
    assert cold["checksum_share_cold"] == 0.0 and cold["checksum_share_cold_measured"] == pytest.approx(-0.3004671)
    text = markdown(results, summary)
    assert "| 256 | 4 | 2179 | 2563 | 1830 | – | 15.0% | 1118 | 859 | 1207 | – | 0.0%\\* |" in text.splitlines()
    assert (
        "\\* Noise on a shared machine: the load with verify=False took longer than the one with verify=True "
        "(256 MiB at 4 ranks: 30.0% longer), so verifying's share is shown as 0% (clamped, not measured)."
    ) in text.splitlines()
    assert not re.findall(r"(?<![\w.])-\d+(\.\d+)?%", text)


def test_counts_take_their_number():
    assert [counted(1, "rank"), counted(2, "rank"), counted(0, "file")] == ["1 rank", "2 ranks", "0 files"]
    assert [counted(1, "process", "processes"), counted(4, "process", "processes")] == ["1 process", "4 processes"]


def test_reports_word_counts_of_one_in_the_singular():
    results = json.loads(RUN.read_text())["results"]
    results["reps"] = 1
    text = markdown(results, summarize(results))
    assert "; 1 repetition, medians;" in text
    assert "1 repetitions" not in text and "(es)" not in text and "(s)" not in text
    ceilings = {
        "disk": [
            {
                "size_mib": 64,
                "world": 1,
                "load": [0.5],
                **{k: {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1} for k in ("write", "read_cold", "read_warm")},
            }
        ],
        "memcpy": [{"mib": 64, "threads": 1, "load": [0.5], "median": 1.0, "min": 1.0, "max": 1.0, "n": 1}],
    }
    for rows in ceilings.values():
        for row in rows:
            for entry in [row] + [row[k] for k in ("write", "read_cold", "read_warm") if k in row]:
                entry.update(cpu_per_wall=0.5, runq_per_wall=0.0, starved=False)
    lines = markdown_ceilings(ceilings)
    assert "| disk: write + fsync | 64 MiB over 1 process | 1 (1-1) | 0.50 | 0.00 | 0.5 |  |" in lines
    assert "| memory copy | 64 MiB, 1 thread | 1 (1-1) | 0.50 | 0.00 | 0.5 |  |" in lines
