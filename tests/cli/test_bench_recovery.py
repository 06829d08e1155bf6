"""`ckpt bench recovery`: the lost-host scenario under torchrun's elastic agent at a tiny size as a
user runs it (report shape, phases, bytes by source and verdicts; no timing asserted beyond being
positive), and its report's pure functions on made-up events."""

from __future__ import annotations

import json

import pytest
from helpers.bench_cli import ckpt_bench

from ckptlib.bench.recovery_summary import PHASES, checks, markdown, phases, slowdown, summarize

SHARDS = 1000  # shard-file bytes of the made-up checkpoint


def _events() -> list[dict]:
    """A job at world 4 that saved step 2 and trained step 3 before the host was lost at t=10;
    two restarted workers at world 2 (the survivors' workers stopped at t=11)."""
    before = [{"kind": "started", "t": 1.0, "rank": r, "world": 4, "restart": 0, "pid": 100 + r} for r in range(4)] + [
        {"kind": "saved", "t": 4.0, "rank": 0, "step": 2, "digest": 77, "pid": 100},
        {"kind": "step", "t": 5.0, "rank": 0, "step": 3, "loss": 0.25, "pid": 100},
        {"kind": "step", "t": 5.0, "rank": 3, "step": 3, "loss": 0.25, "pid": 103},
    ]
    peer, remote = {"local": SHARDS, "remote": 0}, {"local": 0, "remote": SHARDS}
    after = []
    for rank, (started, load_start, load_end, seconds, stepped) in enumerate(
        [(14.0, 15.0, 16.0, 0.75, 16.5), (14.5, 15.25, 16.25, 0.875, 16.75)]
    ):
        who = {"rank": rank, "world": 2, "restart": 1, "pid": 200 + rank}
        after += [
            {"kind": "started", "t": started, **who},
            {"kind": "load_start", "t": load_start, **who},
            {"kind": "load_end", "t": load_end, "seconds": seconds, "step": 2, "bytes_by_source": peer, **who},
            {"kind": "step", "t": stepped, "step": 3, "loss": 0.25, **who},
        ]
        for t, source, sources, s in [(17.0, "peer", peer, 0.125), (18.0, "remote", remote, 1.0)]:
            after.append(
                {"kind": "restore", "t": t, "source": source, "seconds": s, "step": 2, "bytes_by_source": sources}
                | {"checkpoint_bytes": SHARDS + 24, "digest": 77, **who}
            )
    return before + after


def test_phases_follow_one_another_from_the_loss_to_the_first_step():
    rep = phases(_events(), lost_at=10.0, stopped_at=11.0)
    assert rep["detect_seconds"] == 1.0  # to the survivors' workers stopped
    assert rep["rendezvous_seconds"] == 3.5  # to the last restarted worker up (14.5)
    assert rep["setup_seconds"] == 0.75  # to the last load start (15.25)
    assert rep["load_seconds"] == 0.875  # the slowest rank's mgr.load
    assert rep["first_step_seconds"] == 0.5  # from the last load's end (16.25) to step 3 on every rank (16.75)
    assert rep["total_seconds"] == 6.75
    assert (rep["world_size"], rep["ranks_restarted"], rep["resumed_step"], rep["first_step"]) == (2, 2, 2, 3)
    assert rep["loss_before_kill"] == [0.25] and rep["saved_digest"] == [77]
    assert rep["restore"]["remote"]["seconds"] == 1.0 and rep["restore"]["peer"]["bytes_by_source"]["remote"] == 0
    assert rep["first_step_loss"] == [0.25, 0.25] and rep["later_worker_starts"] == 0
    assert all(checks(rep, save_step=2).values()), checks(rep, save_step=2)


def test_an_old_worker_finishing_a_step_as_the_host_goes_is_not_a_restarted_one():
    """The bench kills the host once any rank trained step 3; a survivor's old worker can log its
    own step 3 just after (CI saw three first-step losses at world 2)."""
    events = _events() + [{"kind": "step", "t": 10.5, "rank": 2, "world": 4, "step": 3, "loss": 0.25, "pid": 102}]
    rep = phases(events, lost_at=10.0, stopped_at=11.0)
    assert rep["first_step_loss"] == [0.25, 0.25] and rep["ranks_restarted"] == 2
    assert rep["total_seconds"] == 6.75 and rep["later_worker_starts"] == 0


def test_a_second_restart_is_counted_and_leaves_the_first_recovery_timed():
    """A restarted worker dying at teardown (gloo's abort) makes the agent start the group again:
    its events are not the recovery's; the first restore of each source is kept."""
    later = []
    for rank in (0, 1):
        who = {"rank": rank, "world": 2, "restart": 2, "pid": 300 + rank}
        later += [
            {"kind": "started", "t": 30.0, **who},
            {"kind": "load_end", "t": 31.0, "seconds": 9.0, "step": 2, "bytes_by_source": {"local": 1}, **who},
            {"kind": "step", "t": 32.0, "step": 3, "loss": 0.25, **who},
            {"kind": "restore", "t": 33.0, "source": "peer", "seconds": 9.0, "step": 2, "bytes_by_source": {}}
            | {"checkpoint_bytes": 1, "digest": 78, **who},
        ]
    rep = phases(_events() + later, lost_at=10.0, stopped_at=11.0)
    assert rep["later_worker_starts"] == 2 and rep["first_step_loss"] == [0.25, 0.25]
    assert (rep["total_seconds"], rep["load_seconds"]) == (6.75, 0.875)
    assert rep["restore"]["peer"]["seconds"] == 0.125 and rep["restore"]["peer"]["digest"] == 77
    assert all(checks(rep, save_step=2).values()), checks(rep, save_step=2)


@pytest.mark.parametrize(
    ("broken", "check"),
    [
        ("loss", "loss_bit_exact"),
        ("digest", "state_bit_exact"),
        ("peer_remote", "peer_read_no_remote_bytes"),
        ("remote_short", "remote_read_every_shard_byte"),
        ("step", "resumed_saved_step"),
    ],
)
def test_a_resume_that_is_not_exact_or_reads_the_remote_fails_its_check(broken, check):
    events = _events()
    for e in events:
        if broken == "loss" and e["kind"] == "step" and e["t"] > 10 and e["rank"] == 1:
            e["loss"] = 0.25000003
        if broken == "digest" and e["kind"] == "restore" and e["source"] == "remote" and e["rank"] == 0:
            e["digest"] = 78
        if broken == "peer_remote" and e["kind"] == "load_end":
            e["bytes_by_source"] = {"local": SHARDS - 10, "remote": 10}
        if broken == "remote_short" and e["kind"] == "restore" and e["source"] == "remote":
            e["bytes_by_source"] = {"local": 0, "remote": SHARDS - 1}
        if broken == "step" and e["kind"] == "load_end":
            e["step"] = 1
    result = checks(phases(events, 10.0, 11.0), save_step=2)
    assert [name for name, ok in result.items() if not ok] == [check]


def test_slowdown_takes_the_slowest_rank_per_step_and_ratios_within_a_repetition():
    rank0 = {"none": [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], "thread": [[1.0, 1.5, 1.5], [2.0, 3.0, 3.0]]}
    rank1 = {"none": [[1.0, 1.25, 1.0], [2.0, 2.0, 2.0]], "thread": [[2.0, 1.0, 1.0], [2.0, 2.0, 5.0]]}
    rank0["process"], rank1["process"] = rank0["none"], rank1["none"]
    s = slowdown([rank0, rank1])
    assert s["step_seconds_by_rep"]["none"] == [1.0, 2.0]  # medians of [1, 1.25, 1] and [2, 2, 2]
    assert s["step_seconds_by_rep"]["thread"] == [1.5, 3.0]  # medians of [2, 1.5, 1.5] and [2, 3, 5]
    assert s["ratio"] == {"none": 1.0, "thread": 1.5, "process": 1.0}
    assert s["median_step_seconds"]["thread"] == 2.25


def test_verdicts_are_judged_against_s3_only_and_a_miss_says_missed():
    rep = phases(_events(), 10.0, 11.0)
    slow = {
        "ratio": {"none": 1.0, "thread": 1.2, "process": 1.25},
        "median_step_seconds": dict.fromkeys(("none", "thread", "process"), 1.0),
    }
    report = {"size_mib": 4, "state_bytes": SHARDS, "remote": "s3", "reps": [rep], "slowdown": slow}
    report["machine"] = {"load_average_at_start": (1.0, 1.0, 1.0), "load_average_at_end": (2.0, 1.0, 1.0), "cpus": 2}
    report["summary"] = summarize([rep], slow, "s3")
    verdicts = report["summary"]["verdicts"]
    assert verdicts["peer_restore_speedup"]["measured"] == 8.0 and verdicts["peer_restore_speedup"]["met"]
    assert verdicts["in_memory_slowdown_process"] == {
        "goal": "in-memory tier, async save every step, process writer: step time <= 1.05x",
        "measured": 1.25,
        "met": False,
    }
    text = markdown(report)
    assert "| 8.0x | met |" in text and "| 1.25x | **missed** |" in text
    assert set(report["summary"]["medians"]) == {*PHASES, "total_seconds", "restore_seconds"}
    assert not summarize([rep], slow, "dir")["verdicts"]["peer_restore_speedup"]["met"]
    report["remote"], report["summary"] = "dir", summarize([rep], slow, "dir")
    assert "not judged (remote dir" in markdown(report)


@pytest.mark.slow
@pytest.mark.elastic
@pytest.mark.timeout(900)
def test_bench_recovery_quick_times_every_phase_and_resumes_from_peers(tmp_path):
    out = tmp_path / "recovery.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = ckpt_bench("recovery", "--quick", "--json", str(out), "--dir", str(scratch), timeout=840)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["size_mib"] == 4 and report["remote"] == "s3"
    (rep,) = report["reps"]
    assert all(rep["checks"].values()), rep["checks"]
    assert (rep["world_size"], rep["ranks_restarted"], rep["resumed_step"]) == (2, 2, report["save_step"])
    medians = report["summary"]["medians"]
    for key in (*PHASES, "total_seconds"):
        assert rep[key] > 0 and medians[key] == rep[key], key
    assert set(medians["restore_seconds"]) == {"peer", "remote"} and min(medians["restore_seconds"].values()) > 0
    peer, remote = (rep["restore"][s]["bytes_by_source"] for s in ("peer", "remote"))
    shard_bytes = sum(peer.values())
    assert rep["resume_bytes_by_source"]["remote"] == 0 and peer["remote"] == 0
    assert remote == {"local": 0, "remote": shard_bytes}  # every shard byte, all from S3
    # 4 MiB of float32 parameters and AdamW's two moments: the shard files hold at least that
    assert 3 * 4 << 20 <= shard_bytes < report["state_bytes"]
    assert rep["first_step_loss"] == rep["loss_before_kill"] * 2  # both restarted ranks, bit for bit
    for verdict in report["summary"]["verdicts"].values():
        assert set(verdict) >= {"goal", "measured", "met"} and verdict["measured"] > 0
    slow = report["slowdown"]
    assert slow["loaded_back_bit_exact"] and set(slow["ratio"]) == {"none", "thread", "process"}
    assert slow["ratio"]["none"] == 1.0
    for row in ("| **median** |", "| process writer |", "| restore from peers >= 5x faster"):
        assert row in run.stdout
    assert list(scratch.iterdir()) == []  # the scratch directory is removed
