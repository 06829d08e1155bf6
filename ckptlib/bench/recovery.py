"""A lost host under torchrun's real elastic agent, timed phase by phase (issue 34).

Two simulated hosts of 2 ranks, each with its own node-local root, run torchrun's elastic agent
(`--nnodes 1:2`, a c10d rendezvous on a standalone TCPStore this process hosts, `is_host=false`,
`--max-restarts 3`) with the FSDP2 loop of `ckptlib.bench.recovery_worker`:
`CheckpointManager(node_root, keep_last=2, cluster=Cluster(replicas=1, remote=...))`, the remote
on a moto S3 server on 127.0.0.1 (`--remote s3`) or a directory (`--remote dir`). Once a step is
saved (replicas and upload done) and the next one trained, the host running rank 0 is lost:
SIGKILL of its agent and every worker (found through /proc: each worker is in a session of its
own), its root wiped. The survivors' agent restarts its workers at world 2 by itself. Reported
per repetition and as medians, the slowest rank's, each phase after the one before:
detect_seconds (host lost to the survivors' workers stopped), rendezvous_seconds (to the
restarted workers' process group up), setup_seconds (model and manager, to the load's start),
load_seconds (`mgr.load`), first_step_seconds (to the first step trained); and
restore_seconds {"peer", "remote"}: the same step loaded again at world 2 from the survivor's
root (its own files and the replicas peers wrote), then from an empty root (the remote alone),
in a rotating order, with the bytes by source.

Then the step slowdown of an async save every step to an in-memory tier: node roots under
/dev/shm, `Cluster(replicas=1)`, the thread and the process writer against the same loop
without checkpoints, interleaved in one run (4 ranks on 2 simulated nodes).

Goals: restore from peers >= 5x faster than from S3 at the same size; in-memory tier step
slowdown <= 1.05x with the process writer. A missed goal is reported as missed.

Run: ckpt bench recovery [--size-mib 64] [--reps 3] [--steps 8] [--remote s3|dir] [--quick]
                         [--json [OUT]] [--dir DIR] [--timeout 600]

Exit status: 0; 1 when a resume was not bit-exact (the first step's loss after the restart
differs from the loss logged for that step before the kill, or a restored state's digest from
the saved one), resumed another step, a resume from peers read bytes from the remote, the
remote restore did not read every shard byte from the remote, or the scenario did not complete;
2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from ckptlib.bench import emit, help_description
from ckptlib.bench.recovery_summary import checks, markdown, phases, slowdown, summarize
from ckptlib.bench.recovery_worker import rank_slowdown

SAVE_STEP = 2
#: The rendezvous knobs a cluster sets too: a round closes 2 s after enough agents joined
#: (default 30 s), a lost agent's heartbeat is missed after 3 x 2 s.
RDZV_CONF = {"last_call_timeout": "2", "join_timeout": "300", "keep_alive_interval": "2"}


def _log(msg: str) -> None:
    print(f"[bench recovery {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class ScenarioError(RuntimeError):
    """The scenario did not run to its end (a hung or failed job); carries the launchers' output."""


def _wait_for(what: str, predicate, nodes, deadline: float) -> None:
    while not predicate():
        if time.monotonic() > deadline or all(code is not None for code in nodes.returncodes()):
            raise ScenarioError(f"gave up waiting for {what}\n{nodes.tails()}")
        time.sleep(0.05)


def lose_a_host(args, rep: int, endpoint: str, remote: str, base: str, env: dict[str, str]) -> dict[str, Any]:
    """One repetition of the scenario: its events, when the host was lost and when the
    survivors' workers had stopped."""
    from ckptlib.testing.harness.nodes import Nodes, running, worker_with_rank

    hosts = [f"{base}/host{k}" for k in (0, 1)]
    log = f"{base}/events.jsonl"

    def target(node: int) -> list[str]:
        return [
            *("-m", "ckptlib.bench.recovery_worker", "--root", hosts[node], "--remote", remote, "--events", log),
            *("--host", str(node), "--size-mib", str(args.size_mib), "--save-step", str(SAVE_STEP)),
            *("--rep", str(rep)),
        ]

    deadline = time.monotonic() + args.timeout
    with Nodes.start(
        target, [2, 2], f"{base}/logs", env=env, elastic=(endpoint, "1:2"), rdzv_conf=RDZV_CONF, max_restarts=3
    ) as nodes:
        trained = lambda: any(e["kind"] == "step" and e["step"] == SAVE_STEP + 1 for e in _events(log))  # noqa: E731
        _wait_for(f"step {SAVE_STEP} saved and step {SAVE_STEP + 1} trained at world 4", trained, nodes, deadline)
        lost = worker_with_rank(nodes, 0)
        if lost is None:
            raise ScenarioError(f"no worker has rank 0\n{nodes.tails()}")
        survivors = nodes.worker_pids(1 - lost)
        lost_at = time.time()
        nodes.kill(lost)
        wipe = threading.Thread(target=shutil.rmtree, args=(hosts[lost],), kwargs={"ignore_errors": True})
        wipe.start()  # its disk is lost with it, while the bench watches the survivors
        while any(running(pid) for pid in survivors):
            if time.monotonic() > deadline:
                raise ScenarioError(f"the survivors' workers never stopped\n{nodes.tails()}")
            time.sleep(0.005)
        stopped_at = time.time()
        wipe.join()
        finished = nodes.wait(max(1.0, deadline - time.monotonic()))
        code = nodes.returncodes()[1 - lost]
        if not finished or code != 0:
            raise ScenarioError(f"the survivors' job ended with {code} (finished: {finished})\n{nodes.tails()}")
    return {"events": _events(log), "lost_at": lost_at, "stopped_at": stopped_at, "lost_host": lost}


def _machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptlib.testing import launch
    from ckptlib.testing.harness.nodes import launcher_env

    report: dict[str, Any] = {
        "command": "ckpt bench recovery " + " ".join(args.argv),
        "machine": _machine(),
        "size_mib": args.size_mib,
        "remote": args.remote,
        "save_step": SAVE_STEP,
    }
    base = tempfile.mkdtemp(prefix="ckptlib-bench-recovery-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="ckptlib-bench-recovery-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    reps = []
    try:
        with contextlib.ExitStack() as stack:
            env = launcher_env()
            if args.remote == "s3":
                from ckptlib.testing.fakes.s3_server import create_bucket, s3_env, start_moto_server

                endpoint_url = stack.enter_context(start_moto_server())
                aws = s3_env(endpoint_url)
                env = {k: v for k, v in env.items() if k not in aws}
                env.update({k: v for k, v in aws.items() if v is not None})
                remote_base = f"s3://{create_bucket(endpoint_url, 'bench-recovery')}"
            else:
                remote_base = f"{base}/remote"
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
            endpoint = f"127.0.0.1:{store.port}"
            for rep in range(args.reps):
                _log(f"repetition {rep + 1}/{args.reps}: {args.size_mib} MiB, 2 hosts x 2 ranks, remote {args.remote}")
                scene = lose_a_host(args, rep, endpoint, f"{remote_base}/rep{rep}", f"{base}/rep{rep}", env)
                rep_report = phases(scene["events"], scene["lost_at"], scene["stopped_at"])
                rep_report["lost_host"] = scene["lost_host"]
                rep_report["checks"] = checks(rep_report, SAVE_STEP)
                reps.append(rep_report)
                _log(", ".join(f"{k} {rep_report[k]:.2f}" for k in ("detect_seconds", "total_seconds")))
                shutil.rmtree(f"{base}/rep{rep}", ignore_errors=True)
            del store
            _log(f"in-memory tier: an async save every step to {shm}, thread and process writers, interleaved")
            ranks = launch(4, rank_slowdown, shm, args.size_mib, args.reps, args.steps, nodes=2, timeout=args.timeout)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    report["reps"] = reps
    report["state_bytes"] = reps[0]["restore"]["remote"]["checkpoint_bytes"]
    report["slowdown"] = slowdown([r["times"] for r in ranks])
    report["slowdown"]["steps_per_mode"] = args.steps
    report["slowdown"]["loaded_back_bit_exact"] = all(r["ok"] for r in ranks)
    report["summary"] = summarize(reps, report["slowdown"], args.remote)
    report["ok"] = report["slowdown"]["loaded_back_bit_exact"] and all(all(r["checks"].values()) for r in reps)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    return report


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ckpt bench recovery", description=help_description(__doc__))
    parser.add_argument(
        "--size-mib", type=int, default=64, help="model parameters in MiB, layers of 4 MiB (default 64)"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode of the in-memory tier (default 8)")
    parser.add_argument("--remote", choices=["s3", "dir"], default="s3", help="the remote (default s3: moto)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 MiB, 1 repetition, 3 steps per mode")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT", help="the JSON report")
    parser.add_argument("--dir", default=None, help="scratch directory (default: the system's temporary one)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for each repetition and for the slowdown run"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mib, args.reps, args.steps = 4, 1, 3
    if args.size_mib < 1 or args.reps < 1 or args.steps < 1:
        parser.error("--size-mib, --reps and --steps must be positive")
    args.argv = argv
    try:
        report = run(args)
    except ScenarioError as exc:
        print(f"ckpt bench recovery: {exc}", file=sys.stderr)
        return 1
    text = markdown(report)
    emit(text, report, args.json)
    if not report["ok"]:
        failed = sorted({k for r in report["reps"] for k, ok in r["checks"].items() if not ok})
        print(f"ckpt bench recovery: failed checks: {failed or ['the in-memory loads back']}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
