"""A torchrun worker of the cluster-tier tests (tests/elastic/test_cluster_tier.py).

Run as `python -m torch.distributed.run ... cluster_worker.py PHASE --local-root DIR --out DIR
[--remote URI] [--replicas R] [--steps 1,2]`. First thing, it installs an audit hook that
refuses (and records) any file operation under the roots listed in CKPT_FORBIDDEN (the other
nodes' local roots): a rank must never touch another node's disk. Every rank writes its
outcome to `<out>/<phase>.rank<R>.json` before it leaves, so a gloo abort at teardown is told
apart from a real failure.

Phases: `save` (save each of --steps, waiting for each upload; before the last it waits for
`<out>/go`, so the test can arm a stall first), `resume` (load the newest step, check it
bit for bit, wait for the background upload).
"""

from __future__ import annotations

import os
import sys

from ckptlib import Cluster


def _resolve(path, dir_fd) -> str | None:
    if isinstance(path, int):
        return None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        path = os.fspath(path)
    if dir_fd is not None and not os.path.isabs(path):
        base = os.readlink(f"/proc/self/fd/{dir_fd}")
        path = os.path.join(base, path)
    return os.path.realpath(os.path.abspath(path))


_EVENTS = {
    "open": (0, None),
    "os.listdir": (0, None),
    "os.scandir": (0, None),
    "os.rename": (0, 2),
    "os.remove": (0, 1),
    "os.mkdir": (0, 2),
    "os.rmdir": (0, 1),
    "shutil.rmtree": (0, 1),
}


def install_audit_hook(forbidden: list[str], record: str) -> None:
    """Refuse and record every audited file operation under a `forbidden` root."""
    roots = [os.path.realpath(r) for r in forbidden if r]
    busy = [False]

    def hook(event, args):
        spec = _EVENTS.get(event)
        if spec is None or busy[0] or not roots:
            return
        index, fd_index = spec
        try:
            dir_fd = args[fd_index] if fd_index is not None and len(args) > fd_index else None
            path = _resolve(args[index], dir_fd if isinstance(dir_fd, int) else None)
        except Exception:  # noqa: BLE001 - not a path we can judge
            return
        if path is None:
            return
        for root in roots:
            if path == root or path.startswith(root + os.sep):
                busy[0] = True
                try:
                    with open(record, "a", encoding="utf-8") as f:
                        f.write(f"{event} {path}\n")
                finally:
                    busy[0] = False
                raise PermissionError(f"audit: rank touched another node's root: {event} {path}")

    sys.addaudithook(hook)


if __name__ == "__main__":
    install_audit_hook(
        os.environ.get("CKPT_FORBIDDEN", "").split(os.pathsep), os.environ.get("CKPT_AUDIT", "/dev/null")
    )

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402


def expected(step: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(96, 40, generator=gen),
        "b": torch.randn(37, generator=gen),
        "e": torch.randn(50, 8, generator=gen).to(torch.bfloat16),
    }


def make_state(step: int | None) -> dict:
    """Row-sharded DTensors over every rank (a real reshard at another world size), a
    replicated tensor and a step counter."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = expected(step) if step is not None else {k: torch.zeros_like(v) for k, v in expected(0).items()}
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "e": distribute_tensor(full["e"], mesh, [Shard(0)]),
            "b": full["b"].clone(),
        },
        "step": -1 if step is None else step,
    }


def check(state: dict, step: int) -> list[str]:
    import torch

    want = expected(step)
    problems = []
    for key in ("w", "e", "b"):
        value = state["model"][key]
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if value.dtype != want[key].dtype or not torch.equal(value, want[key]):
            problems.append(key)
    if state["step"] != step:
        problems.append(f"step {state['step']} != {step}")
    return problems


def describe(exc: BaseException) -> dict:
    return {
        "types": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "ranks": list(getattr(exc, "ranks", []) or []),
        "traceback": traceback.format_exc()[-3000:],
    }


def hold_uploads_of_step_2(where: str, rank: int) -> None:
    """Make this rank's uploads of step 2 hang (marking each in `where`): a node whose network
    stalls mid-upload, for a remote that is a plain directory."""
    import ckptlib.manager.cluster.remote_tier as remote_tier

    real = remote_tier.copy_file

    def held(src, dst, name, size, crc):
        if "step_0000000002" in dst.uri:
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, f"rank{rank}"), "w"):
                pass
            time.sleep(3600)
        return real(src, dst, name, size, crc)

    remote_tier.copy_file = held


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["save", "resume"])
    parser.add_argument("--local-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--remote")
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--steps", default="1")
    args = parser.parse_args()

    import warnings

    import torch.distributed as dist

    import ckptlib

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(os.path.join(args.out, "pids"), exist_ok=True)
    with open(os.path.join(args.out, "pids", f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if os.environ.get("CKPT_TEST_HOLD_UPLOADS"):
        hold_uploads_of_step_2(os.environ["CKPT_TEST_HOLD_UPLOADS"], rank)
    out: dict = {"rank": rank, "world": dist.get_world_size(), "group_rank": int(os.environ["GROUP_RANK"])}
    result_path = os.path.join(args.out, f"{args.phase}.rank{rank}.json")
    remote = ckptlib.RemoteTier(args.remote, keep_last=3) if args.remote else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mgr = ckptlib.CheckpointManager(
                args.local_root, keep_last=3, cluster=Cluster(replicas=args.replicas, remote=remote)
            )
            if args.phase == "save":
                steps = [int(s) for s in args.steps.split(",")]
                out["uploads"] = []
                for step in steps:
                    if step == steps[-1] and len(steps) > 1:
                        with open(os.path.join(args.out, f"ready.rank{rank}"), "w"):
                            pass
                        while not os.path.exists(os.path.join(args.out, "go")):
                            time.sleep(0.05)
                    mgr.save(step, make_state(step))
                    uploaded = mgr.wait()
                    out["uploads"].append(None if uploaded is None else uploaded.step)
            else:
                state = make_state(None)
                out["resumed"] = mgr.load(state)
                result = mgr.last_load
                out["problems"] = check(state, out["resumed"])
                out["bytes_by_source"] = dict(getattr(result, "bytes_by_source", {}) or {})
                out["bytes_received"] = getattr(result, "bytes_received", None)
                uploaded = mgr.wait()
                out["uploaded"] = None if uploaded is None else uploaded.step
                out["latest"] = mgr.latest()
            mgr.close()
            out["ok"] = True
        except BaseException as exc:  # noqa: BLE001 - reported in the result file
            out["ok"] = False
            out["error"] = describe(exc)
        out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    with open(result_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(result_path + ".tmp", result_path)
    if not out["ok"]:
        os._exit(0)  # a lost peer: no exit barrier or teardown; 0, so the agent lets the node's other ranks finish
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
