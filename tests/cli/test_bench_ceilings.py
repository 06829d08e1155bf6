"""`ckpt bench`'s ceilings and its robust statistics, at tiny sizes: the arithmetic of paired
ratios, starved rows and % of ceiling on fixed numbers; the disk, memory and loopback
measurements' shapes and counted mechanisms (write calls, evictions, bytes read back); the JSON
and the markdown of a real run (ceilings first)."""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers.bench_cli import ckpt_bench

from ckptlib.bench import ceilings, crc_meter
from ckptlib.bench.ceiling_summary import against_ceilings, markdown_against, summarize_ceilings
from ckptlib.bench.paired import pair_ratios, paired, spread, starved

MiB = 1 << 20


def test_paired_is_the_median_of_per_repetition_ratios_not_a_ratio_of_medians():
    ckptlib = [1.0, 2.0, 10.0]
    ceiling = [1.0, 4.0, 5.0]
    assert pair_ratios(ckptlib, ceiling) == [1.0, 0.5, 2.0]
    got = paired(ckptlib, ceiling)
    assert (got["median"], got["min"], got["max"], got["n"]) == (1.0, 0.5, 2.0, 3)
    # the ratio of the medians would be 2 / 4 = 0.5: a slow repetition of one side moves it
    assert got["median"] != spread(ckptlib)["median"] / spread(ceiling)["median"]


def test_spread_leaves_out_missing_values_and_pairs_with_a_zero_are_missing():
    assert pair_ratios([1.0, 2.0, 3.0], [0.0, None, 1.5]) == pytest.approx([math.nan, math.nan, 2.0], nan_ok=True)
    assert spread([math.nan, None, 3.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}
    empty = spread([])
    assert empty["n"] == 0 and math.isnan(empty["median"])


@pytest.mark.parametrize(
    "share, threads, expected",
    [
        ({"runq_per_wall": 0.30, "cpu_per_wall": 1.0}, 0, True),  # waited for a CPU 30% of the time
        ({"runq_per_wall": 0.10, "cpu_per_wall": 0.2}, 0, False),  # an I/O-bound op: low CPU is fine
        ({"runq_per_wall": 0.10, "cpu_per_wall": 0.6}, 1, True),  # a CPU-bound copy off the core 40%
        ({"runq_per_wall": 0.10, "cpu_per_wall": 1.5}, 2, False),  # 2 threads, 75% of both
        ({"runq_per_wall": math.nan, "cpu_per_wall": math.nan}, 1, False),  # nothing known: not flagged
    ],
)
def test_starved_rows(share, threads, expected):
    assert starved(share, cpu_bound_threads=threads) is expected


def test_write_file_writes_in_chunks_and_syncs(tmp_path, monkeypatch):
    monkeypatch.setattr(ceilings, "CHUNK", 1024)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    data = ceilings.pattern(3000, seed=1)
    path = tmp_path / "f.bin"
    calls = ceilings.write_file(str(path), data, 5000)
    assert calls == 5  # 1024, 1024, 952 (to the pattern's end), 1024, 976: never past the buffer
    raw = path.read_bytes()
    assert len(raw) == 5000 and raw[:3000] == bytes(data) and raw[3000:] == bytes(data)[:2000]
    assert len(synced) == 2  # the file, then its directory


def test_evict_drops_only_that_files_pages(tmp_path, monkeypatch):
    advice = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advice.append((off, n, how)))
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 4096)
    ceilings.evict(str(path))
    assert advice == [(0, 0, os.POSIX_FADV_DONTNEED)]


def test_pattern_is_incompressible():
    import zlib

    data = bytes(ceilings.pattern(1 << 20, seed=3))
    assert len(zlib.compress(data, 1)) > 0.99 * len(data)


def test_disk_ceiling_keeps_every_repetition(tmp_path):
    row = ceilings.disk(str(tmp_path), 3 * MiB + 1, processes=2, reps=2)
    assert row["processes"] == 2 and row["bytes"] == 3 * MiB + 1
    assert row["bytes_read"] == [3 * MiB + 1] * 2  # the cold read got every byte, per repetition
    for phase in ("write", "read_cold", "read_warm"):
        assert len(row[f"{phase}_s"]) == 2 and all(s > 0 for s in row[f"{phase}_s"])
        assert [set(u) for u in row[f"{phase}_usage"]] == [{"wall_s", "cpu_s", "runq_s"}] * 2
    assert os.listdir(tmp_path) == []  # the files are removed
    summary = summarize_ceilings({"disk": [{"size_mib": 3, "world": 2, **row}]})
    assert summary["disk"][0]["write"]["n"] == 2


def test_memcpy_and_loopback_ceilings():
    (one,) = ceilings.memcpy(MiB, reps=3, threads=[1])
    assert one["threads"] == 1 and len(one["seconds"]) == 3 and len(one["usage"]) == 3
    tcp = ceilings.tcp_loopback(2 * MiB + 5, reps=2)
    assert tcp["bytes"] == 2 * MiB + 5 and len(tcp["seconds"]) == 2


def _io_entry(save_ckptlib, save_raw, crc_wall):
    use = [[{"wall_s": s, "cpu_s": s / 2, "runq_s": 0.0} for s in save_ckptlib]]
    return {
        "size_mib": 64,
        "world": 1,
        "shard_bytes": 64 * MiB,
        "times": {"save_ckptlib": save_ckptlib, "save_raw": save_raw},
        "usage": {"save_ckptlib": use},
        "crc": [[{"calls": 1, "bytes": 64 * MiB, "wall_s": w, "cpu_s": w} for w in crc_wall]],
    }


def _disk_ceiling():
    """64 MiB at 1 process: write 128 MiB/s, read 640 (evicted, starved) and 1280 (page cache)."""
    return {
        "disk": [
            {
                "size_mib": 64,
                "world": 1,
                "bytes": 64 * MiB,
                "write_s": [0.5, 0.5, 0.5],
                "write_usage": [{"wall_s": 0.5, "cpu_s": 0.1, "runq_s": 0.0}] * 3,
                "read_cold_s": [0.1] * 3,
                "read_cold_usage": [{"wall_s": 0.1, "cpu_s": 0.1, "runq_s": 0.2}] * 3,
                "read_warm_s": [0.05] * 3,
                "read_warm_usage": [{"wall_s": 0.05, "cpu_s": 0.05, "runq_s": 0.0}] * 3,
            }
        ],
    }


def test_against_ceilings_percent_paired_and_checksum_share():
    ceil = _disk_ceiling()
    results = {"io": [_io_entry([1.0, 1.0, 4.0], [0.5, 1.0, 1.0], [0.1, 0.05, 0.2])], "reshard": [], "cloud": []}
    summary = {"ceilings": summarize_ceilings(ceil)}
    assert summary["ceilings"]["disk"][0]["write"]["median"] == 128.0  # 64 MiB in 0.5 s
    assert summary["ceilings"]["disk"][0]["read_cold"]["starved"]  # run-queue wait twice the wall
    (row,) = against_ceilings(results, summary, lambda v: spread(v)["median"])
    assert row["figure"] == "save" and row["mib_s"] == 64.0 and row["pct_of_ceiling"] == 50.0
    # per repetition: raw / ckptlib seconds = 0.5, 1.0, 0.25 (ckptlib's throughput over the raw write's)
    assert (row["paired"]["median"], row["paired"]["min"], row["paired"]["max"]) == (0.5, 0.25, 1.0)
    assert row["checksum_share"]["median"] == pytest.approx(0.05)  # 0.1/1, 0.05/1, 0.2/4
    assert row["checksum_cpu_share"]["median"] == pytest.approx(0.1)  # against half the wall in CPU
    assert not row["starved"]
    text = "\n".join(markdown_against([row]))
    assert "| save | 64 | 1 | 64 | 128 | 50% | 0.50 (0.25-1.00) | raw write+fsync |" in text


def test_crc_meter_times_the_save_and_puts_the_functions_back(tmp_path):
    import torch

    import ckptlib
    from ckptlib.format.items import block_checks, checksum, item_encoder

    state = {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(10)}
    with crc_meter.metering() as meter:
        ckptlib.save(str(tmp_path / "c"), state)
    assert meter.bytes >= 1_200_040 and meter.calls > 0 and meter.wall_s > 0
    assert block_checks.crc32 is checksum.crc32 and item_encoder.crc32 is checksum.crc32


def test_ceilings_first_in_a_real_run(tmp_path):
    """A tiny `ckpt bench` run: the JSON keeps every raw ceiling number and per-operation
    usage, and the markdown prints the ceilings before any ckptlib table."""
    out = tmp_path / "bench.json"
    run = ckpt_bench(
        "--sizes",
        "1",
        "--world-sizes",
        "1",
        "--reps",
        "2",
        "--no-s3",
        "--no-rss",
        "--no-reshard",
        "--no-async",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    ceil = report["results"]["ceilings"]
    assert [(d["size_mib"], d["world"]) for d in ceil["disk"]] == [(1, 1)]
    assert len(ceil["disk"][0]["write_s"]) == 2 and len(ceil["tcp"]["seconds"]) == 2
    assert ceil["gloo"]["ok"] and len(ceil["gloo"]["seconds"]) == 2
    assert {m["threads"] for m in ceil["memcpy"]} >= {1}
    (io,) = report["results"]["io"]
    assert len(io["times"]["save_ckptlib"]) == 2 and len(io["usage"]["save_ckptlib"][0]) == 2
    assert len(io["times"]["load_raw_warm"]) == 2 and len(io["times"]["load_ckptlib_verify_cold"]) == 2
    assert len(io["crc"][0]) == 2
    figures = {r["figure"] for r in report["summary"]["against"]}
    assert {"save", "load warm", "load cold"} <= figures
    text = run.stdout
    assert text.index("This machine's ceilings") < text.index("Save throughput") < text.index("against its ceilings")


def test_resharded_load_against_the_read_ceiling_and_same_n():
    """A resharded load's % of ceiling is against the page-cache read at M processes; its paired
    figure is its time over the same-N load's, repetition by repetition."""
    summary = {"ceilings": summarize_ceilings(_disk_ceiling())}
    reshard = [
        {"size_mib": 64, "saved": 2, "loaded": 1, "verify": True, "times": [0.1, 0.1, 0.2]},
        {"size_mib": 64, "saved": 1, "loaded": 1, "verify": True, "times": [0.08, 0.1, 0.1]},
    ]
    (row,) = against_ceilings({"io": [], "reshard": reshard, "cloud": []}, summary, lambda v: spread(v)["median"])
    assert row["figure"] == "resharded load 2->1" and row["ceiling_mib_s"] == 1280.0
    assert row["mib_s"] == 640.0 and row["pct_of_ceiling"] == 50.0
    assert (row["paired"]["median"], row["paired"]["min"], row["paired"]["max"]) == (1.25, 1.0, 2.0)
    assert "| resharded load 2->1 | 64 | 1 | 640 | 1280 | 50% | 1.25 (1.00-2.00) |" in "\n".join(
        markdown_against([row])
    )
