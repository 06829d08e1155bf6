"""`ckpt bench`'s report: throughputs, ratios and target verdicts from the raw timings
(`summarize`), and the markdown tables (`markdown`). Also what `--from-json` reads back."""

from __future__ import annotations

import statistics
from typing import Any

from ckptlib.bench import counted
from ckptlib.bench.ceiling_summary import against_ceilings, markdown_against, markdown_ceilings, summarize_ceilings
from ckptlib.bench.cloud_sdk import markdown_cloud, summarize_cloud
from ckptlib.bench.paired import paired
from ckptlib.bench.rank_ops import MiB

TARGETS = {
    "cloud_save": 0.9,  # ckptlib save throughput >= 0.9x the cloud SDK's plain upload of the same bytes
    "cloud_load": 0.9,  # ... and its load >= 0.9x the SDK's plain download
    "save_vs_dcp": 0.9,  # ckptlib save throughput >= 0.9x raw DCP at the same world size
    "save_vs_raw": 0.8,  # ... and >= 0.8x the raw parallel write + fsync (median of per-repetition ratios)
    "save_checksum": 0.10,  # CRC-32 calls <= 10% of the save's wall time (largest rank, median)
    "reshard": 1.15,  # resharded load time <= 1.15x same-N load time
    "checksum": 0.10,  # (verify - no verify) / verify load time <= 10%
    "rss_factor": 1.5,  # load peak RSS per rank <= 1.5x shard + 300 MiB
    "rss_slack_mib": 300,
    "async_block": 0.10,  # blocking part of an async save <= 10% of a sync save (>= 256 MiB)
}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _cloud_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The cloud rows of a run (older JSON files call them "s3")."""
    return results.get("cloud") or results.get("s3") or []


def _best(values: list[float]) -> float:
    return min(values) if values else float("nan")


ESTIMATORS = {"median": lambda values: _median(values), "best": _best}


def _tp(size_mib: int, seconds: float) -> float:
    return size_mib / seconds if seconds and seconds == seconds else float("nan")


def verify_share(verify_s: float | None, noverify_s: float | None) -> tuple[float, float]:
    """(the share of a verified load's time that verifying adds, as measured): the measured
    (verify - no verify) / verify, clamped to 0 when noise made the verified load the faster one
    (a share cannot be negative; the table marks such a figure)."""
    if not verify_s or not noverify_s:
        return float("nan"), float("nan")
    measured = (verify_s - noverify_s) / verify_s
    return max(0.0, measured), measured


def summarize(results: dict[str, Any], estimator: str = "median") -> dict[str, Any]:
    """Throughputs, ratios and target verdicts from the raw timings, each timing aggregated
    over the repetitions by `estimator`: "median", or "best" (the fastest repetition: on a
    shared machine, noise only ever adds time, so the best run is the least disturbed)."""
    _median = ESTIMATORS[estimator]
    summary: dict[str, Any] = {
        "save": [],
        "load": [],
        "reshard": [],
        "rss": [],
        "async": [],
        "cloud": [],
        "targets": {},
    }
    verdict: dict[str, list] = {
        k: []
        for k in (
            "save_vs_dcp",
            "save_vs_raw",
            "reshard",
            "reshard_noverify",
            "checksum",
            "checksum_cold",
            "rss",
            "async_block",
            "async_block_bg",
            "cloud_save",
            "cloud_load",
            "save_checksum",
        )
    }
    summary["ceilings"] = summarize_ceilings(results.get("ceilings"))
    summary["against"] = against_ceilings(results, summary, _median)
    paired_save = {
        (r["size_mib"], r["world"]): r for r in summary["against"] if r["figure"] == "save" and r["paired"]["n"]
    }
    for e in results["io"]:
        t = {k: _median(v) for k, v in e["times"].items()}
        size, ws = e["size_mib"], e["world"]
        row = {
            "size_mib": size,
            "world": ws,
            "ok": e["ok"],
            "ckptlib": _tp(size, t.get("save_ckptlib")),
            "dcp": _tp(size, t.get("save_dcp")),
            "raw": _tp(size, t.get("save_raw")),
            "torch": _tp(size, t.get("save_torch", float("nan"))),
        }
        row["vs_dcp"] = row["ckptlib"] / row["dcp"]
        row["vs_raw"] = row["ckptlib"] / row["raw"]
        summary["save"].append(row)
        verdict["save_vs_dcp"].append((row["vs_dcp"], f"{size} MiB, {counted(ws, 'rank')}"))
        fig = paired_save.get((size, ws))
        # the median of per-repetition ratios where the run has them (older JSON: ratio of medians)
        verdict["save_vs_raw"].append(
            (fig["paired"]["median"] if fig else row["vs_raw"], f"{size} MiB, {counted(ws, 'rank')}")
        )
        if fig and fig["checksum_share"]["n"]:
            verdict["save_checksum"].append((fig["checksum_share"]["median"], f"{size} MiB, {counted(ws, 'rank')}"))
        lrow = {"size_mib": size, "world": ws}
        for key in (
            "ckptlib_verify_warm",
            "ckptlib_noverify_warm",
            "dcp_warm",
            "torch_warm",
            "ckptlib_verify_cold",
            "ckptlib_noverify_cold",
            "dcp_cold",
            "torch_cold",
        ):
            lrow[key] = _tp(size, t.get(f"load_{key}", float("nan")))
        for suffix, mode in (("", "warm"), ("_cold", "cold")):
            share, measured = verify_share(t.get(f"load_ckptlib_verify_{mode}"), t.get(f"load_ckptlib_noverify_{mode}"))
            lrow[f"checksum_share{suffix}"] = share
            lrow[f"checksum_share{suffix}_measured"] = measured
        if lrow["checksum_share_cold"] == lrow["checksum_share_cold"]:
            verdict["checksum_cold"].append((lrow["checksum_share_cold"], f"{size} MiB, {counted(ws, 'rank')}"))
        summary["load"].append(lrow)
        verdict["checksum"].append((lrow["checksum_share"], f"{size} MiB, {counted(ws, 'rank')}"))
        if "save_async_total" in t:
            sync = t["save_ckptlib"]
            first = _median(e["async_blocking"].get("first", []))
            steady = _median(e["async_blocking"].get("steady", []))
            bg_block = _median(e["async_blocking"].get("bg_steady", []))
            bg_staged = _median(e["async_blocking"].get("bg_staged", []))
            arow = {
                "size_mib": size,
                "world": ws,
                "sync_s": sync,
                "first_block_s": first,
                "steady_block_s": steady,
                "total_s": t["save_async_total"],
                "first_ratio": first / sync,
                "steady_ratio": steady / sync if steady == steady else float("nan"),
                "bg_block_s": bg_block,
                "bg_staged_s": bg_staged,
                "bg_ratio": bg_block / sync,
            }
            summary["async"].append(arow)
            if size >= 256:
                use = arow["steady_ratio"] if arow["steady_ratio"] == arow["steady_ratio"] else arow["first_ratio"]
                verdict["async_block"].append((use, f"{size} MiB, {counted(ws, 'rank')} (steady state)"))
                if bg_block == bg_block:
                    verdict["async_block_bg"].append((arow["bg_ratio"], f"{size} MiB, {counted(ws, 'rank')}"))
    same = {
        (r["size_mib"], r["loaded"], r["verify"]): _median(r["times"])
        for r in results["reshard"]
        if r["saved"] == r["loaded"]
    }
    for r in results["reshard"]:
        if r["saved"] == r["loaded"]:
            continue
        base = same.get((r["size_mib"], r["loaded"], r["verify"]))
        secs = _median(r["times"])
        ratio = secs / base if base else float("nan")
        base_times = next(
            (
                x["times"]
                for x in results["reshard"]
                if x["saved"] == x["loaded"] == r["loaded"]
                and x["size_mib"] == r["size_mib"]
                and x["verify"] == r["verify"]
            ),
            [],
        )
        pair = paired(r["times"], base_times)
        if pair["n"]:
            ratio = pair["median"]  # the median of per-repetition ratios (older JSON: ratio of medians)
        summary["reshard"].append(
            {
                **{k: r[k] for k in ("size_mib", "saved", "loaded", "verify")},
                "seconds": secs,
                "same_n_seconds": base,
                "ratio": ratio,
                "ratio_min": pair["min"],
                "ratio_max": pair["max"],
            }
        )
        if r["size_mib"] >= 256 or len({x["size_mib"] for x in results["reshard"]}) == 1:
            verdict["reshard" if r["verify"] else "reshard_noverify"].append(
                (ratio, f"{r['size_mib']} MiB {r['saved']}->{r['loaded']}")
            )
    for r in results["rss"]:
        shard = r["shard_bytes"] / MiB
        limit = TARGETS["rss_factor"] * shard + TARGETS["rss_slack_mib"]
        row = {"size_mib": r["size_mib"], "world": r["world"], "shard_mib": shard, "limit_mib": limit}
        for op in ("load_ckptlib", "load_dcp", "save_ckptlib", "save_dcp"):
            row[f"{op}_mib"] = r[op] / MiB
            row[f"{op}_over_base"] = (r[op] - r[f"{op}_baseline"]) / MiB
            row[f"{op}_extra"] = r.get(f"{op}_extra", float("nan")) / MiB
        summary["rss"].append(row)
        verdict["rss"].append((row["load_ckptlib_mib"] / limit, f"{r['size_mib']} MiB, {counted(r['world'], 'rank')}"))
    summary["cloud"] = summarize_cloud(_cloud_rows(results), _median)
    for r in summary["cloud"]:
        if "skipped" not in r:
            where = f"{r['backend']} {r['size_mib']} MiB, {counted(r['world'], 'rank')}"
            verdict["cloud_save"].append((r["save_ratio"], where))
            verdict["cloud_load"].append((r["load_ratio"], where))
    limits = {
        "save_vs_dcp": (">=", TARGETS["save_vs_dcp"]),
        "save_vs_raw": (">=", TARGETS["save_vs_raw"]),
        "reshard": ("<=", TARGETS["reshard"]),
        "reshard_noverify": ("<=", TARGETS["reshard"]),
        "checksum": ("<=", TARGETS["checksum"]),
        "checksum_cold": ("<=", TARGETS["checksum"]),
        "rss": ("<=", 1.0),
        "async_block": ("<=", TARGETS["async_block"]),
        "async_block_bg": ("<=", TARGETS["async_block"]),
        "cloud_save": (">=", TARGETS["cloud_save"]),
        "cloud_load": (">=", TARGETS["cloud_load"]),
        "save_checksum": ("<=", TARGETS["save_checksum"]),
    }
    for name, values in verdict.items():
        values = [(v, where) for v, where in values if v == v]
        if not values:
            summary["targets"][name] = {"status": "not measured"}
            continue
        op, limit = limits[name]
        worst = min(values) if op == ">=" else max(values)
        met = all((v >= limit) if op == ">=" else (v <= limit) for v, _ in values)
        misses = [where for v, where in values if not ((v >= limit) if op == ">=" else (v <= limit))]
        summary["targets"][name] = {
            "status": "met" if met else "missed",
            "worst": worst[0],
            "where": worst[1],
            "limit": f"{op} {limit}",
            "misses": misses,
        }
    return summary


def _f(x: float, digits: int = 0) -> str:
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def _share(row: dict[str, Any], suffix: str, clamped: list[str]) -> str:
    """A load row's checksum share as a percentage, marked * (and its measured value kept in
    `clamped`, as how much longer the unverified load took) when it was clamped to 0."""
    share = row[f"checksum_share{suffix}"]
    measured = row.get(f"checksum_share{suffix}_measured", share)
    if measured == measured and measured < 0:
        clamped.append(f"{row['size_mib']} MiB at {counted(row['world'], 'rank')}: {-100 * measured:.1f}% longer")
        return f"{_f(100 * share, 1)}%\\*"
    return f"{_f(100 * share, 1)}%"


def markdown(results: dict[str, Any], summary: dict[str, Any], estimator: str = "median") -> str:
    out = []
    out.append(f"Command: `{results['command']}`  ")
    if results.get("commit"):
        out.append(f"Code: commit {results['commit']}  ")
    m = results["machine"]
    how = "medians" if estimator == "median" else "best (fastest) repetition of each"
    out.append(
        f"Machine: {m['cpus']} CPUs, Python {m['python']}, torch {m.get('torch')}, CRC-32 via `{m.get('crc32')}`; "
        f"{counted(results['reps'], 'repetition')}, {how}; "
        f"loads {'warm and cold' if results['cold_loads'] else 'from the page cache'}."
    )
    load = results.get("load_average") or {}
    if load:
        out.append(f"Load average (1, 5, 15 min) at the start: {load.get('start')}, at the end: {load.get('end')}.")
    out.append("")
    ceilings = markdown_ceilings(summary.get("ceilings") or {})
    if ceilings:
        out += ceilings + [""]
    out.append("### Save throughput (MiB/s; ratios are ckptlib / baseline)")
    out.append("| state MiB | ranks | ckptlib | raw DCP | raw write+fsync | torch.save | ckptlib/DCP | ckptlib/raw |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in summary["save"]:
        out.append(
            f"| {r['size_mib']} | {r['world']} | {_f(r['ckptlib'])} | {_f(r['dcp'])} | {_f(r['raw'])} | "
            f"{_f(r['torch'])} | {_f(r['vs_dcp'], 2)} | {_f(r['vs_raw'], 2)} |"
        )
    out.append("")
    out.append("### Load throughput (MiB/s)")
    cold = results["cold_loads"]
    head = "| state MiB | ranks | ckptlib verify | ckptlib no verify | raw DCP | torch.load | checksum share |"
    sep = "|---:|---:|---:|---:|---:|---:|---:|"
    if cold:
        head += " cold: ckptlib verify | cold: no verify | cold: DCP | cold: torch.load | cold checksum share |"
        sep += "---:|---:|---:|---:|---:|"
    out.append(head)
    out.append(sep)
    clamped = []
    for r in summary["load"]:
        line = (
            f"| {r['size_mib']} | {r['world']} | {_f(r['ckptlib_verify_warm'])} | {_f(r['ckptlib_noverify_warm'])} | "
            f"{_f(r['dcp_warm'])} | {_f(r['torch_warm'])} | {_share(r, '', clamped)} |"
        )
        if cold:
            line += (
                f" {_f(r['ckptlib_verify_cold'])} | {_f(r['ckptlib_noverify_cold'])} | {_f(r['dcp_cold'])} | "
                f"{_f(r['torch_cold'])} | {_share(r, '_cold', clamped)} |"
            )
        out.append(line)
    if clamped:
        out.append("")
        out.append(
            "\\* Noise on a shared machine: the load with verify=False took longer than the one with "
            f"verify=True ({', '.join(clamped)}), so verifying's share is shown as 0% (clamped, not measured)."
        )
    if summary["reshard"]:
        out.append("")
        out.append("### Resharded load (warm): saved at N, loaded at M, against the same state saved at M")
        out.append("| state MiB | N → M | verify | seconds | same-N seconds | ratio |")
        out.append("|---:|---|---|---:|---:|---:|")
        for r in summary["reshard"]:
            out.append(
                f"| {r['size_mib']} | {r['saved']} → {r['loaded']} | {r['verify']} | {_f(r['seconds'], 3)} | "
                f"{_f(r['same_n_seconds'], 3)} | {_f(r['ratio'], 2)} |"
            )
    if summary["rss"]:
        out.append("")
        out.append("### Peak RSS per rank (MiB; fresh rank processes forked from a forkserver that imported torch)")
        out.append(
            "In brackets: the peak above the rank's RSS once its state (or load template) existed, i.e. "
            "what the save or load itself needed."
        )
        out.append("")
        out.append(
            "| state MiB | ranks | shard | load ckptlib | load DCP | limit 1.5×shard+300 | save ckptlib | save DCP |"
        )
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in summary["rss"]:
            out.append(
                f"| {r['size_mib']} | {r['world']} | {_f(r['shard_mib'])} | {_f(r['load_ckptlib_mib'])} "
                f"(+{_f(r['load_ckptlib_extra'])}) | {_f(r['load_dcp_mib'])} (+{_f(r['load_dcp_extra'])}) | "
                f"{_f(r['limit_mib'])} | {_f(r['save_ckptlib_mib'])} (+{_f(r['save_ckptlib_extra'])}) | "
                f"{_f(r['save_dcp_mib'])} (+{_f(r['save_dcp_extra'])}) |"
            )
    if summary["async"]:
        out.append("")
        out.append("### Async save: time `async_save(...)` blocks the caller")
        out.append(
            "| state MiB | ranks | sync save s | first async: blocked s | later async: blocked s | async total s "
            "| first/sync | later/sync | background staging: blocked s | staged after s | blocked/sync |"
        )
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in summary["async"]:
            out.append(
                f"| {r['size_mib']} | {r['world']} | {_f(r['sync_s'], 3)} | {_f(r['first_block_s'], 3)} | "
                f"{_f(r['steady_block_s'], 3)} | {_f(r['total_s'], 3)} | {_f(r['first_ratio'], 3)} | "
                f"{_f(r['steady_ratio'], 3)} | {_f(r['bg_block_s'], 3)} | {_f(r['bg_staged_s'], 3)} | "
                f"{_f(r['bg_ratio'], 3)} |"
            )
    out.extend(markdown_cloud(summary.get("cloud", []), _f))
    out.extend(markdown_against(summary.get("against", [])))
    out.append("")
    out.append("### Targets")
    out.append("| target | limit | worst | where | status |")
    out.append("|---|---|---:|---|---|")
    names = {
        "save_vs_dcp": "save vs raw DCP",
        "save_vs_raw": "save vs raw parallel write + fsync (paired)",
        "save_checksum": "checksums' share of the save's wall time",
        "reshard": "resharded / same-N load (verify=True)",
        "reshard_noverify": "resharded / same-N load (verify=False)",
        "checksum": "checksum share of load (page cache)",
        "checksum_cold": "checksum share of load (cold cache)",
        "rss": "load peak RSS / (1.5×shard+300 MiB)",
        "async_block": "async blocking / sync save (≥256 MiB)",
        "async_block_bg": "async blocking, background staging / sync save (≥256 MiB)",
        "cloud_save": "cloud save / the SDK's plain upload",
        "cloud_load": "cloud load / the SDK's plain download",
    }
    for key, label in names.items():
        t = summary["targets"].get(key, {"status": "not measured"})
        if t["status"] == "not measured":
            out.append(f"| {label} | | | | not measured |")
        else:
            others = [w for w in t.get("misses", []) if w != t["where"]]
            extra = f" (also: {'; '.join(others)})" if t["status"] == "missed" and others else ""
            out.append(f"| {label} | {t['limit']} | {_f(t['worst'], 2)} | {t['where']} | {t['status']}{extra} |")
    bad = [e for e in results["io"] if not e["ok"]] + [r for r in _cloud_rows(results) if not r.get("ok", True)]
    if bad:
        out.append("")
        out.append(
            f"**Round-trip check failed** in {counted(len(bad), 'configuration')}: loaded values differ from "
            "saved ones."
        )
    for note in results["notes"]:
        out.append(f"\nNote: {note}.")
    return "\n".join(out)
