"""`ckpt bench`'s ceilings in the report: the machine's ceilings summarized (`summarize_ceilings`),
every ckptlib figure as a share of its ceiling and as the median of its per-repetition ratios
to the ceiling measured beside it (`against_ceilings`), and their markdown tables, printed first.

Which ceiling each figure is read against:

| figure | ceiling (machine, measured first) | measured beside it in the same repetition |
|---|---|---|
| save | parallel write + fsync of the same bytes at the same N | the ranks' raw write + fsync of their shards |
| load (warm, cold) | read of the same bytes (page cache, evicted) | the ranks' raw read of those files |
| async staging (blocked) | memory copy, 1 thread | the rank copying its shards into preallocated buffers |
| resharded load | read of the same bytes at M processes (page cache) | the same-N load (saved at M, loaded at M) |
| cloud save / load | TCP over loopback | the SDK's plain upload / download of the same bytes |
"""

from __future__ import annotations

from typing import Any, Callable

from ckptlib.bench import counted
from ckptlib.bench.paired import paired, shares, spread, starved, throughputs

MiB = 1 << 20


def _mib_s(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    return spread(throughputs(nbytes, seconds))


def _row_shares(per_rank_usage: list[list[dict[str, float]]]) -> dict[str, float]:
    """The worst rank's CPU/wall and run-queue/wall shares (ranks wait at the same barriers)."""
    found = [shares(u) for u in per_rank_usage if u]
    if not found:
        return {"cpu_per_wall": float("nan"), "runq_per_wall": float("nan")}
    runq = [s["runq_per_wall"] for s in found if s["runq_per_wall"] == s["runq_per_wall"]]
    return {
        "cpu_per_wall": min(s["cpu_per_wall"] for s in found),
        "runq_per_wall": max(runq) if runq else float("nan"),
    }


def summarize_ceilings(ceilings: dict[str, Any] | None) -> dict[str, Any]:
    """Each ceiling as MiB/s (median, min, max), with its CPU share, run-queue share, load and
    whether it was starved."""
    if not ceilings:
        return {}
    out: dict[str, Any] = {"disk": [], "memcpy": [], "tcp": None, "gloo": None, "errors": ceilings.get("errors", [])}
    for row in ceilings.get("disk", []):
        entry = {"size_mib": row["size_mib"], "world": row["world"], "load": row.get("load_before")}
        for phase in ("write", "read_cold", "read_warm"):
            share = shares(row[f"{phase}_usage"])
            entry[phase] = {**_mib_s(row["bytes"], row[f"{phase}_s"]), **share, "starved": starved(share)}
        out["disk"].append(entry)
    for row in ceilings.get("memcpy", []):
        share = shares(row["usage"])
        out["memcpy"].append(
            {
                "threads": row["threads"],
                "mib": row["bytes"] // MiB,
                **_mib_s(row["bytes"], row["seconds"]),
                **share,
                "starved": starved(share, cpu_bound_threads=row["threads"]),
                "load": row.get("load_before"),
            }
        )
    for name in ("tcp", "gloo"):
        row = ceilings.get(name)
        if row:
            share = shares(row["usage"])
            out[name] = {
                "mib": row["bytes"] // MiB,
                **_mib_s(row["bytes"], row["seconds"]),
                **share,
                "starved": starved(share),
                "load": row.get("load_before"),
            }
    return out


def _disk(ceilings: dict[str, Any], size: int, world: int, phase: str) -> float:
    for row in ceilings.get("disk", []):
        if (row["size_mib"], row["world"]) == (size, world):
            return row[phase]["median"]
    return float("nan")


def _pct(value: float, ceiling: float) -> float:
    return 100.0 * value / ceiling if ceiling and ceiling == ceiling and value == value else float("nan")


def _figure(name: str, size: int, world: int, mib_s: float, ceiling: float, pair: dict, versus: str, use) -> dict:
    share = _row_shares(use)
    return {
        "figure": name,
        "size_mib": size,
        "world": world,
        "mib_s": mib_s,
        "ceiling_mib_s": ceiling,
        "pct_of_ceiling": _pct(mib_s, ceiling),
        "paired": pair,
        "versus": versus,
        **share,
        "starved": starved(share),
    }


def against_ceilings(results: dict[str, Any], summary: dict[str, Any], aggregate: Callable) -> list[dict[str, Any]]:
    """Every ckptlib figure of the run next to its ceiling: % of the machine's ceiling, and
    the median [min-max] of its per-repetition ratio to the ceiling measured beside it."""
    ceil = summary.get("ceilings") or {}
    rows: list[dict[str, Any]] = []
    for e in results["io"]:
        size, ws, t, use = e["size_mib"], e["world"], e["times"], e.get("usage", {})
        nbytes = size * MiB
        tp = aggregate(throughputs(nbytes, t.get("save_ckptlib", [])))
        row = _figure(
            "save",
            size,
            ws,
            tp,
            _disk(ceil, size, ws, "write"),
            paired(t.get("save_raw", []), t.get("save_ckptlib", [])),
            "raw write+fsync",
            use.get("save_ckptlib", []),
        )
        row["checksum_share"] = spread(_crc_shares(e, "wall_s"))
        row["checksum_cpu_share"] = spread(_crc_shares(e, "cpu_s"))
        rows.append(row)
        for mode, phase in (("warm", "read_warm"), ("cold", "read_cold")):
            for verify in ("verify", "noverify"):
                key = f"load_ckptlib_{verify}_{mode}"
                if not t.get(key):
                    continue
                rows.append(
                    _figure(
                        f"load {mode}" + (" (verify=False)" if verify == "noverify" else ""),
                        size,
                        ws,
                        aggregate(throughputs(nbytes, t[key])),
                        _disk(ceil, size, ws, phase),
                        paired(t.get(f"load_raw_{mode}", []), t[key]),
                        "raw read",
                        use.get(key, []),
                    )
                )
        steady = e.get("async_blocking", {}).get("steady", [])
        if steady:
            memcpy = next((m["median"] for m in ceil.get("memcpy", []) if m["threads"] == 1), float("nan"))
            shard = e.get("shard_bytes", nbytes // ws)
            rows.append(
                _figure(
                    "async staging (blocked)",
                    size,
                    ws,
                    aggregate(throughputs(shard, steady)),
                    memcpy,
                    paired(t.get("stage_memcpy", []), steady),
                    "memcpy of the shard",
                    use.get("stage_memcpy", []),
                )
            )
    same = {(r["size_mib"], r["loaded"], r["verify"]): r for r in results["reshard"] if r["saved"] == r["loaded"]}
    for r in results["reshard"]:
        base = same.get((r["size_mib"], r["loaded"], r["verify"]))
        if r["saved"] == r["loaded"] or base is None:
            continue
        nbytes = r["size_mib"] * MiB
        row = _figure(
            f"resharded load {r['saved']}->{r['loaded']}" + ("" if r["verify"] else " (verify=False)"),
            r["size_mib"],
            r["loaded"],
            aggregate(throughputs(nbytes, r["times"])),
            _disk(ceil, r["size_mib"], r["loaded"], "read_warm"),  # resharded loads are warm
            paired(r["times"], base["times"]),  # a time ratio: below 1 is faster than same-N
            "same-N load (time ratio)",
            r.get("usage", []),
        )
        rows.append(row)
    tcp = (ceil.get("tcp") or {}).get("median", float("nan"))
    for r in results.get("cloud") or []:
        if "skipped" in r or "times" not in r:
            continue
        t = r["times"]
        nbytes = r["size_mib"] * MiB
        for op, sdk in (("save", "save_sdk"), ("load", "load_sdk")):
            if t.get(f"{op}_ckptlib"):
                rows.append(
                    _figure(
                        f"{r['backend']} {op}",
                        r["size_mib"],
                        r["world"],
                        aggregate(throughputs(nbytes, t[f"{op}_ckptlib"])),
                        tcp,
                        paired(t.get(sdk, []), t[f"{op}_ckptlib"]),
                        "SDK's plain transfer",
                        r.get("usage", {}).get(f"{op}_ckptlib", []),
                    )
                )
    return rows


def _crc_shares(entry: dict[str, Any], field: str) -> list[float]:
    """Per repetition, the largest share of a rank's save spent in CRC-32 calls (`field`:
    "wall_s", or "cpu_s" against the rank's CPU time for the save)."""
    per_rank_crc = entry.get("crc") or []
    per_rank_use = entry.get("usage", {}).get("save_ckptlib", [])
    out = []
    for rep, crcs in enumerate(zip(*per_rank_crc)) if per_rank_crc else []:
        values = []
        for rank, crc in enumerate(crcs):
            use = per_rank_use[rank][rep] if rank < len(per_rank_use) and rep < len(per_rank_use[rank]) else None
            if use and use[field]:
                values.append(crc[field] / use[field])
        if values:
            out.append(max(values))
    return out


def _f(x: float | None, digits: int = 0) -> str:
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def _range(s: dict[str, Any], digits: int = 0) -> str:
    return f"{_f(s['median'], digits)} ({_f(s['min'], digits)}-{_f(s['max'], digits)})" if s.get("n") else "–"


def _percent_text(pct: float) -> str:
    return "–" if pct != pct else f"{pct:.0f}%"


def _flag(row: dict[str, Any]) -> str:
    return "**starved**" if row.get("starved") else ""


def markdown_ceilings(ceil: dict[str, Any]) -> list[str]:
    """The ceilings table (printed before everything else)."""
    if not ceil:
        return []
    out = [
        "### This machine's ceilings (MiB/s: median (min-max); CPU and run-queue wait per wall second)",
        "| ceiling | setting | MiB/s | CPU/wall | run-queue/wall | load avg | |",
        "|---|---|---:|---:|---:|---|---|",
    ]

    def line(name: str, setting: str, row: dict[str, Any], load) -> None:
        load_text = " / ".join(f"{x:g}" for x in (load or [])[:1]) or "–"
        out.append(
            f"| {name} | {setting} | {_range(row)} | {_f(row['cpu_per_wall'], 2)} | "
            f"{_f(row['runq_per_wall'], 2)} | {load_text} | {_flag(row)} |"
        )

    for row in ceil.get("disk", []):
        setting = f"{row['size_mib']} MiB over {counted(row['world'], 'process', 'processes')}"
        line("disk: write + fsync", setting, row["write"], row["load"])
        line("disk: read, evicted", setting, row["read_cold"], row["load"])
        line("disk: read, page cache", setting, row["read_warm"], row["load"])
    for row in ceil.get("memcpy", []):
        line("memory copy", f"{row['mib']} MiB, {counted(row['threads'], 'thread')}", row, row["load"])
    for name, label in (("tcp", "loopback TCP"), ("gloo", "loopback gloo send/recv")):
        row = ceil.get(name)
        if row:
            line(label, f"{row['mib']} MiB, 2 processes", row, row["load"])
    for error in ceil.get("errors", []):
        out.append(f"\nNot measured: {error}.")
    return out


def markdown_against(rows: list[dict[str, Any]]) -> list[str]:
    """ckptlib's figures against their ceilings."""
    if not rows:
        return []
    out = [
        "",
        "### ckptlib against its ceilings",
        "Paired: the median (min-max) over repetitions of ckptlib's throughput / the ceiling measured "
        "beside it in the same repetition (for resharded loads: seconds / same-N seconds). "
        "Starved: the run-queue wait was at least a quarter of the wall time.",
        "",
        "| figure | state MiB | ranks | ckptlib MiB/s | ceiling MiB/s | % of ceiling | paired | against "
        "| CPU/wall | run-queue/wall | |",
        "|---|---:|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['figure']} | {r['size_mib']} | {r['world']} | {_f(r['mib_s'])} | {_f(r['ceiling_mib_s'])} | "
            f"{_percent_text(r['pct_of_ceiling'])} | {_range(r['paired'], 2)} | {r['versus']} | "
            f"{_f(r['cpu_per_wall'], 2)} | {_f(r['runq_per_wall'], 2)} | {_flag(r)} |"
        )
    saves = [r for r in rows if r["figure"] == "save" and r.get("checksum_share", {}).get("n")]
    if saves:
        out += [
            "",
            "Checksums in the save (CRC-32 calls timed inside the save; the largest rank's share per "
            "repetition, median (min-max)):",
            "",
            "| state MiB | ranks | share of save wall time | share of save CPU time |",
            "|---:|---:|---:|---:|",
        ]
        for r in saves:
            out.append(
                f"| {r['size_mib']} | {r['world']} | {_range(_percent(r['checksum_share']), 1)}% | "
                f"{_range(_percent(r['checksum_cpu_share']), 1)}% |"
            )
    return out


def _percent(s: dict[str, Any]) -> dict[str, Any]:
    return {**s, **{k: 100 * s[k] for k in ("median", "min", "max") if s.get(k) == s.get(k)}}
