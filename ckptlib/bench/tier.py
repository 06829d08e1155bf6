"""The cluster tier against its baselines, side by side in one run (issue 24's targets).

Ranks run as 2 simulated nodes (torchrun's GROUP_RANK per rank), each node with its own local
root, and a remote on a moto S3 server on 127.0.0.1 (`--remote s3`) or a local directory
(`--remote dir`). Every repetition measures, in a rotating order where two methods compete:

- blocking time of a save: `CheckpointManager(node_root, replicas=1, remote=...)` against a
  plain `CheckpointManager(shared_root)` save of the same state (each the manager's second
  save, so neither pays its first-save set-up); target tier / plain <= 1.1;
- aggregate upload throughput: the tier's upload of a committed step (every rank its own
  files, CRC-checked, one remote commit) against every rank uploading the same files at once
  with the SDK (boto3's `upload_file`; for a directory, copy + fsync); target >= 0.9;
- resume: a load at the same world size with every local tier intact, then with node 1's root
  wiped: the bytes read from the remote over the checkpoint's bytes (targets <= 1% and 0).

Run: ckpt bench tier [--ranks 4] [--size-mib 256] [--reps 3] [--remote s3|dir] [--quick]
                     [--json [OUT]] [--dir DIR]

Times are the slowest rank's (barriers around each timed call), medians over the repetitions.
Exit status: 0 when every load was bit-exact and no resume after a lost node read the remote,
1 otherwise, 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ckptlib.bench import counted, emit, help_description
from ckptlib.bench.rank_ops import barrier, local_bytes, make_state, rank_world, same_values, settle, timed

BLOCKING_TARGET = 1.1
UPLOAD_TARGET = 0.9
RESUME_INTACT_TARGET = 0.01


def _sdk_uploader(local_dir: str, remote_uri: str, names: list[str]):
    """This rank's files with the plain SDK (its client made before the clock starts): boto3's
    managed upload with its default settings, or copy + fsync for a directory."""
    if remote_uri.startswith("s3://"):
        import boto3

        bucket, _, prefix = remote_uri[len("s3://") :].partition("/")
        client = boto3.session.Session().client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])

        def s3_upload() -> None:
            for name in names:
                client.upload_file(os.path.join(local_dir, name), bucket, f"{prefix}/{name}")

        return s3_upload

    def copy() -> None:
        os.makedirs(remote_uri, exist_ok=True)
        for name in names:
            target = os.path.join(remote_uri, name)
            shutil.copyfile(os.path.join(local_dir, name), target)
            with open(target, "rb+") as f:
                os.fsync(f.fileno())

    return copy


def _own_files(rank: int) -> list[str]:
    return [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])


def rank_tier(base: str, remote_base: str, size_mib: int, reps: int) -> dict[str, Any]:
    """One rank's measurements (see the module docstring)."""
    import torch.distributed as dist

    import ckptlib
    from ckptlib.manager.cluster.remote_tier import RemoteTier
    from ckptlib.manager.options import Cluster
    from ckptlib.storage import open_storage

    rank, world = rank_world()
    node = int(os.environ["GROUP_RANK"])
    state = make_state(size_mib)
    times: dict[str, list[float]] = {}
    extra: dict[str, list[float]] = {}
    ok = True
    for rep in range(reps):
        run = f"{base}/rep{rep}"
        remote = f"{remote_base}/rep{rep}"
        node_root = f"{run}/node{node}"
        order = ["plain", "tier"] if rep % 2 == 0 else ["tier", "plain"]
        for method in order:
            if method == "plain":
                mgr = ckptlib.CheckpointManager(f"{run}/plain")
            else:
                mgr = ckptlib.CheckpointManager(node_root, cluster=Cluster(replicas=1, remote=RemoteTier(remote)))
            mgr.save(1, state)
            mgr.wait()
            settle()
            times.setdefault(f"blocking_{method}", []).append(timed(lambda: mgr.save(2, state)))
            started = time.perf_counter()
            mgr.wait()  # the tier's replicas and upload, after the timed part
            extra.setdefault(f"background_{method}", []).append(time.perf_counter() - started)
            mgr.close()
        # -- uploads: the tier's (a fresh prefix) against the SDK's, of the same files ------
        local_step = open_storage(node_root).child("step_0000000002")
        manifest_bytes = local_step.read("ckptlib.json")
        up_order = ["tier", "sdk"] if rep % 2 == 0 else ["sdk", "tier"]
        for method in up_order:
            target = f"{remote}-upload-{method}"
            settle()
            if method == "tier":
                tier = RemoteTier(target)
                seconds = timed(lambda: tier.upload(2, manifest_bytes, local_step, _own_files(rank)))
            else:
                seconds = timed(_sdk_uploader(f"{node_root}/step_0000000002", target, _own_files(rank)))
            times.setdefault(f"upload_{method}", []).append(seconds)
        # -- resume: every local tier intact, then node 1's root lost -----------------------
        for case in ("intact", "node1_lost"):
            if case == "node1_lost":
                barrier()
                if rank == world // 2:  # node 1's leader
                    shutil.rmtree(node_root, ignore_errors=True)
                barrier()
            template = make_state(size_mib, fill=False)
            mgr = ckptlib.CheckpointManager(node_root, cluster=Cluster(replicas=1, remote=RemoteTier(remote)))
            seconds = timed(lambda: mgr.load(template))
            result = mgr.last_load
            mgr.wait()
            mgr.close()
            ok = ok and same_values(state, template) and result.step == 2
            times.setdefault(f"resume_{case}", []).append(seconds)
            extra.setdefault(f"remote_fraction_{case}", []).append(
                result.bytes_by_source.get("remote", 0) / max(1, sum(result.bytes_by_source.values()))
            )
        barrier()
        if rank == 0:
            shutil.rmtree(run, ignore_errors=True)
        dist.barrier()
    return {"rank": rank, "times": times, "extra": extra, "ok": ok, "shard_bytes": local_bytes(state)}


def _log(msg: str) -> None:
    print(f"[bench tier {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import contextlib

    import torch

    from ckptlib.testing import launch

    base = tempfile.mkdtemp(prefix="ckptlib-bench-tier-", dir=args.dir)
    results: dict[str, Any] = {
        "command": "ckpt bench tier " + " ".join(args.argv),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_at_start": os.getloadavg(),
        },
        "ranks": args.ranks,
        "size_mib": args.size_mib,
        "reps": args.reps,
        "remote": args.remote,
    }
    try:
        with contextlib.ExitStack() as stack:
            if args.remote == "s3":
                from ckptlib.testing.fakes.s3_server import create_bucket, s3_env, start_moto_server

                endpoint = stack.enter_context(start_moto_server())
                env = {k: v for k, v in s3_env(endpoint).items() if v is not None}
                remote_base = f"s3://{create_bucket(endpoint, 'bench')}/tier"
            else:
                env, remote_base = {}, f"{base}/remote"
            _log(f"{args.size_mib} MiB at {counted(args.ranks, 'rank')} on 2 nodes, remote {args.remote}")
            out = launch(
                args.ranks,
                rank_tier,
                f"{base}/local",
                remote_base,
                args.size_mib,
                args.reps,
                nodes=2,
                env=env,
                timeout=args.timeout,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results["ok"] = all(r["ok"] for r in out)
    results["times"] = {
        key: [max(r["times"][key][i] for r in out) for i in range(args.reps)] for key in out[0]["times"]
    }
    results["extra"] = {
        key: [max(r["extra"][key][i] for r in out) for i in range(args.reps)] for key in out[0]["extra"]
    }
    results["state_bytes"] = sum(r["shard_bytes"] for r in out)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    return results


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    t = {key: statistics.median(values) for key, values in results["times"].items()}
    x = {key: statistics.median(values) for key, values in results["extra"].items()}
    mib = results["state_bytes"] / (1 << 20)
    return {
        "blocking_tier_s": t["blocking_tier"],
        "blocking_plain_s": t["blocking_plain"],
        "blocking_ratio": t["blocking_tier"] / t["blocking_plain"],
        "background_tier_s": x["background_tier"],
        "upload_tier_mib_s": mib / t["upload_tier"],
        "upload_sdk_mib_s": mib / t["upload_sdk"],
        "upload_ratio": t["upload_sdk"] / t["upload_tier"],
        "resume_intact_s": t["resume_intact"],
        "resume_node1_lost_s": t["resume_node1_lost"],
        "remote_fraction_intact": max(results["extra"]["remote_fraction_intact"]),
        "remote_fraction_node1_lost": max(results["extra"]["remote_fraction_node1_lost"]),
    }


def markdown(results: dict[str, Any], s: dict[str, Any]) -> str:
    def verdict(met: bool) -> str:
        return "met" if met else "**not met**"

    return "\n".join(
        [
            f"{results['size_mib']} MiB, {counted(results['ranks'], 'rank')} on 2 nodes, remote {results['remote']}, "
            f"{counted(results['reps'], 'rep')} (medians); load average "
            f"{results['machine']['load_average_at_start'][0]:.1f}",
            "",
            "| measure | cluster tier | baseline | ratio | target |",
            "|---|---:|---:|---:|---|",
            f"| save, blocking time | {s['blocking_tier_s']:.3f} s | {s['blocking_plain_s']:.3f} s "
            f"(plain local save) | {s['blocking_ratio']:.2f}x "
            f"| <= {BLOCKING_TARGET}x: {verdict(s['blocking_ratio'] <= BLOCKING_TARGET)} |",
            f"| upload, aggregate | {s['upload_tier_mib_s']:.0f} MiB/s | {s['upload_sdk_mib_s']:.0f} MiB/s "
            f"({results['ranks']} concurrent SDK uploads) | {s['upload_ratio']:.2f}x "
            f"| >= {UPLOAD_TARGET}x: {verdict(s['upload_ratio'] >= UPLOAD_TARGET)} |",
            f"| resume, local tiers intact | {s['resume_intact_s']:.3f} s | | remote bytes "
            f"{100 * s['remote_fraction_intact']:.2f}% | <= {100 * RESUME_INTACT_TARGET:.0f}%: "
            f"{verdict(s['remote_fraction_intact'] <= RESUME_INTACT_TARGET)} |",
            f"| resume, node 1 lost, replicas=1 | {s['resume_node1_lost_s']:.3f} s | | remote bytes "
            f"{100 * s['remote_fraction_node1_lost']:.2f}% | 0%: {verdict(s['remote_fraction_node1_lost'] == 0)} |",
            "",
            f"Replicas and upload after a save (background, not blocking): {s['background_tier_s']:.3f} s.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ckpt bench tier", description=help_description(__doc__))
    parser.add_argument("--ranks", type=int, default=4, help="ranks in all, on 2 nodes (even; default 4)")
    parser.add_argument("--size-mib", type=int, default=256, help="checkpoint size in MiB (default 256)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--remote", choices=["s3", "dir"], default="s3", help="the remote (default s3: moto)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 MiB, 1 repetition")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT", help="the JSON report")
    parser.add_argument("--dir", default=None, help="scratch directory (default: the system's temporary one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.ranks % 2:
        parser.error("--ranks must be even and at least 2 (2 nodes)")
    if args.quick:
        args.size_mib, args.reps = 8, 1
    args.argv = argv
    results = run(args)
    summary = summarize(results)
    results["summary"] = summary
    text = markdown(results, summary)
    emit(text, results, args.json)
    return 0 if results["ok"] and summary["remote_fraction_node1_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
