"""The report of `ckpt bench recovery`: phases from the workers' events, medians, verdicts and
the table; pure functions of the recorded data, so they are tested on their own."""

from __future__ import annotations

import statistics
from typing import Any

from ckptlib.bench import counted

PHASES = ("detect_seconds", "rendezvous_seconds", "setup_seconds", "load_seconds", "first_step_seconds")
#: Restore from peers' replicas at least this many times faster than from the remote (S3).
PEER_SPEEDUP_TARGET = 5.0
#: An async save every step to the in-memory tier (process writer): step time at most this ratio.
SLOWDOWN_TARGET = 1.05


def phases(events: list[dict], lost_at: float, stopped_at: float) -> dict[str, Any]:
    """One repetition's recovery from its events (every rank's; those after `lost_at` are the
    restarted workers'): the phases in seconds, slowest rank's, one after another -
    detect (host lost to the survivors' workers stopped, `stopped_at`), rendezvous (to the last
    restarted worker's process group up), setup (to the last rank's load start: model, manager),
    load (the slowest rank's `mgr.load`), first_step (the last load's end to the first step
    trained by every rank) - their total, and what the resume read and computed.

    Only the restarted workers count: per rank, the first process started after the loss. An
    old worker still logs a step it finished as the host went, and the agent starts another
    worker if a restarted one dies (gloo's teardown abort): those are left out and the later
    starts counted in `later_worker_starts`."""
    first_pid: dict[int, int] = {}
    for e in sorted((e for e in events if e["t"] > lost_at and e["kind"] == "started"), key=lambda e: e["t"]):
        first_pid.setdefault(e["rank"], e["pid"])
    all_after = [e for e in events if e["t"] > lost_at]
    after = [e for e in all_after if first_pid.get(e["rank"]) == e["pid"]]
    started = [e for e in after if e["kind"] == "started"]
    load_start = [e for e in after if e["kind"] == "load_start"]
    load_end = [e for e in after if e["kind"] == "load_end"]
    steps = [e for e in after if e["kind"] == "step"]
    if not (started and load_end and steps):
        raise ValueError("the restarted workers logged no start, load or step")
    first = min(e["step"] for e in steps)
    first_done = max(e["t"] for e in steps if e["step"] == first)
    out = {
        "detect_seconds": stopped_at - lost_at,
        "rendezvous_seconds": max(e["t"] for e in started) - stopped_at,
        "setup_seconds": max(e["t"] for e in load_start) - max(e["t"] for e in started),
        "load_seconds": max(e["seconds"] for e in load_end),
        "first_step_seconds": first_done - max(e["t"] for e in load_end),
        "total_seconds": first_done - lost_at,
        "world_size": started[0]["world"],
        "ranks_restarted": len({e["rank"] for e in started}),
        "resumed_step": load_end[0]["step"],
        "resume_bytes_by_source": load_end[0]["bytes_by_source"],
        "first_step": first,
        "first_step_loss": [e["loss"] for e in steps if e["step"] == first],
        "later_worker_starts": sum(e["kind"] == "started" for e in all_after) - len(first_pid),
    }
    before = [e for e in events if e["t"] <= lost_at]
    out["loss_before_kill"] = sorted({e["loss"] for e in before if e["kind"] == "step" and e["step"] == first})
    out["saved_digest"] = sorted({e["digest"] for e in before if e["kind"] == "saved"})
    restarted = {e["pid"] for e in all_after if e["kind"] == "started"}
    restores = [e for e in all_after if e["kind"] == "restore" and e["rank"] == 0 and e["pid"] in restarted]
    out["restore"] = {}  # each source's first restore, a later worker's if the first died before it
    for e in sorted(restores, key=lambda e: e["t"]):
        fields = {k: e[k] for k in ("seconds", "step", "bytes_by_source", "checkpoint_bytes", "digest")}
        out["restore"].setdefault(e["source"], fields)
    return out


def checks(rep: dict[str, Any], save_step: int) -> dict[str, bool]:
    """Whether the repetition's resume was what it must be: bit-exact (the first step's loss is
    the one logged before the kill; every restore's digest is the saved state's), of the step
    saved, the peers' resumes reading nothing from the remote, the remote's resume every shard
    byte the peers' read, all of it from the remote."""
    restore = rep["restore"]
    digests = {source: r["digest"] for source, r in restore.items()}
    peer = restore.get("peer", {}).get("bytes_by_source", {})
    remote = restore.get("remote", {}).get("bytes_by_source", {})
    return {
        "resumed_saved_step": rep["resumed_step"] == save_step
        and all(r["step"] == save_step for r in restore.values()),
        "loss_bit_exact": len(rep["loss_before_kill"]) == 1
        and set(rep["first_step_loss"]) == set(rep["loss_before_kill"]),
        "state_bit_exact": len(rep["saved_digest"]) == 1
        and set(digests) == {"peer", "remote"}
        and set(digests.values()) == set(rep["saved_digest"]),
        "peer_read_no_remote_bytes": rep["resume_bytes_by_source"].get("remote", 0) == 0
        and bool(peer)
        and peer.get("remote", 0) == 0,
        "remote_read_every_shard_byte": sum(remote.values()) > 0
        and remote.get("remote", 0) == sum(remote.values()) == sum(peer.values()),
    }


def slowdown(times: list[dict[str, list[list[float]]]]) -> dict[str, Any]:
    """Every rank's step times (mode -> per repetition -> per step) to the slowest rank's step,
    its median per repetition and mode, and per mode the median over repetitions of its ratio to
    no checkpoints in the same repetition."""
    modes = list(times[0])
    reps = len(times[0][modes[0]])
    per_rep = {
        mode: [statistics.median(max(steps) for steps in zip(*(r[mode][i] for r in times))) for i in range(reps)]
        for mode in modes
    }
    return {
        "median_step_seconds": {mode: statistics.median(values) for mode, values in per_rep.items()},
        "step_seconds_by_rep": per_rep,
        "ratio": {mode: statistics.median(v / n for v, n in zip(per_rep[mode], per_rep["none"])) for mode in modes},
    }


def summarize(reps: list[dict[str, Any]], slow: dict[str, Any], remote: str) -> dict[str, Any]:
    """Medians of the phases and restores over the repetitions, and the two goals' verdicts."""
    medians: dict[str, Any] = {key: statistics.median(r[key] for r in reps) for key in (*PHASES, "total_seconds")}
    medians["restore_seconds"] = {
        source: statistics.median(r["restore"][source]["seconds"] for r in reps) for source in ("peer", "remote")
    }
    speedup = medians["restore_seconds"]["remote"] / medians["restore_seconds"]["peer"]
    process = slow["ratio"]["process"]
    return {
        "medians": medians,
        "verdicts": {
            "peer_restore_speedup": {
                "goal": f"restore from peers >= {PEER_SPEEDUP_TARGET:g}x faster than from S3 at the same size",
                "measured": speedup,
                "remote": remote,
                "met": remote == "s3" and speedup >= PEER_SPEEDUP_TARGET,
            },
            "in_memory_slowdown_process": {
                "goal": f"in-memory tier, async save every step, process writer: step time <= {SLOWDOWN_TARGET:g}x",
                "measured": process,
                "met": process <= SLOWDOWN_TARGET,
            },
        },
    }


def _verdict(v: dict[str, Any]) -> str:
    if "remote" in v and v["remote"] != "s3":
        return f"not judged (remote {v['remote']}, the goal is against S3)"
    return "met" if v["met"] else "**missed**"


def markdown(report: dict[str, Any]) -> str:
    """The tables: one row per repetition and the medians, the restores, the step slowdown."""
    s, reps = report["summary"], report["reps"]
    m = s["medians"]
    lines = [
        f"{report['size_mib']} MiB of parameters ({report['state_bytes'] / (1 << 20):.0f} MiB checkpoint with AdamW), "
        f"2 hosts x 2 ranks, torchrun elastic agent, remote {report['remote']}, {counted(len(reps), 'repetition')}; "
        f"load average {report['machine']['load_average_at_start'][0]:.1f} at the start, "
        f"{report['machine']['load_average_at_end'][0]:.1f} at the end, {report['machine']['cpus']} CPUs",
        "",
        "| repetition | detect | rendezvous | setup | load | first step | total | restore, peer | restore, remote |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, r: dict[str, Any], peer: float, remote: float) -> str:
        cells = " | ".join(f"{r[key]:.2f} s" for key in (*PHASES, "total_seconds"))
        return f"| {name} | {cells} | {peer:.3f} s | {remote:.3f} s |"

    for i, r in enumerate(reps):
        lines.append(row(str(i + 1), r, r["restore"]["peer"]["seconds"], r["restore"]["remote"]["seconds"]))
    lines.append(row("**median**", m, m["restore_seconds"]["peer"], m["restore_seconds"]["remote"]))
    first = reps[0]
    lines += [
        "",
        f"Bytes by source (repetition 1): resume {first['resume_bytes_by_source']}, "
        f"restore from peers {first['restore']['peer']['bytes_by_source']}, "
        f"from the remote {first['restore']['remote']['bytes_by_source']}.",
    ]
    later = [str(i + 1) for i, r in enumerate(reps) if r.get("later_worker_starts")]
    if later:
        lines.append(
            f"The agent restarted the workers again after the recovery in repetition {', '.join(later)} "
            "(a worker died after it; the phases time the first restart)."
        )
    lines += [
        "",
        "| in-memory tier, async save every step | median step | slowdown |",
        "|---|---:|---:|",
    ]
    slow = report["slowdown"]
    for mode in ("none", "thread", "process"):
        label = "no checkpoints" if mode == "none" else f"{mode} writer"
        lines.append(f"| {label} | {slow['median_step_seconds'][mode]:.3f} s | {slow['ratio'][mode]:.2f}x |")
    lines += ["", "| goal | measured | verdict |", "|---|---:|---|"]
    v = s["verdicts"]["peer_restore_speedup"]
    lines.append(f"| {v['goal']} | {v['measured']:.1f}x | {_verdict(v)} |")
    v = s["verdicts"]["in_memory_slowdown_process"]
    lines.append(f"| {v['goal']} | {v['measured']:.2f}x | {_verdict(v)} |")
    return "\n".join(lines)
