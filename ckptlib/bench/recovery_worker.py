"""The ranks of `ckpt bench recovery`: an FSDP2 training loop with a CheckpointManager on the
cluster tier, logging timestamped events for the bench to time the phases of a recovery.

Under torchrun (`python -m ckptlib.bench.recovery_worker ...`, one launcher per simulated host):
the first attempt trains, saves `--save-step` once (waiting for its replicas and upload), logs
the state's digest and trains on until the bench kills a host. A restarted worker resumes, trains
one step, then loads the same step twice more, timed: from this host's root (its own files and
the replicas peers wrote) and from an empty root (the remote alone). Every event is one JSON line
with `t` = time.time() (the wall clock every process on the machine shares), appended to `--log`.

`rank_slowdown` (run by `ckptlib.testing.launch` on 2 simulated nodes) times the same loop's
steps without checkpoints and with an async save every step to node roots on tmpfs, replicas=1.

Bit-exactness without gathering the state: the digest is a sum over every element of
(its float32 bits x a weight of its global index) mod a prime, summed over the ranks, so it is
the same at any world size exactly when the values are. Every rank computes the loss on the
whole batch with the full parameters (FSDP2 gathers them), so a step's loss depends on the
parameters alone, not on the world size: the first step after the restart must repeat the loss
the job logged for that step before the kill, bit for bit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from typing import Any

WIDTH = 1024  # one layer is WIDTH x WIDTH float32: 4 MiB; dim 0 splits evenly over 1, 2 or 4 ranks
LAYER_MIB = WIDTH * WIDTH * 4 >> 20
BATCH = 16
_PRIME = (1 << 31) - 1
_CHUNK = 1 << 20


def layers_for(size_mib: int) -> int:
    """The number of layers of a model of about `size_mib` MiB of parameters (at least one)."""
    return max(1, round(size_mib / LAYER_MIB))


def build(size_mib: int, seed: int = 0):
    """(model, optimizer): `layers_for(size_mib)` bias-free linear layers, each and the whole
    fully_shard'ed over the default group's ranks, and AdamW; the same initial values everywhere."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ckptlib._torch import parallel

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers_for(size_mib))])
    fully_shard = parallel.require_fsdp2_cpu()
    mesh = parallel.init_device_mesh_fn()("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train_step(model, optim, step: int) -> float:
    """One step on the batch of `step` (a function of the step alone); returns its loss."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 + step)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randn(BATCH, WIDTH, generator=gen)
    out = x
    for layer in model:
        out = torch.tanh(layer(out))
    loss = (out - y).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return float(loss.detach())


def _part(local, offset: int, salt: int) -> int:
    """This shard's share of the digest: its elements' bits weighted by their global index."""
    import torch

    flat = local.detach().reshape(-1).view(torch.int32)
    total = 0
    for lo in range(0, flat.numel(), _CHUNK):
        bits = flat[lo : lo + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        index = torch.arange(offset + lo, offset + lo + bits.numel(), dtype=torch.int64)
        weight = (index * 40503 + salt) % 65521 + 1
        total += int(((bits * weight) % _PRIME).sum())
    return total % _PRIME


def digest(model, optim) -> int:
    """The digest of the parameters and AdamW's state (see the module docstring): the same on
    every rank and at every world size for the same values. A collective."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    total = 0
    for salt, param in enumerate(model.parameters()):
        rows = param.shape[0]
        chunk = -(-rows // world)  # FSDP2's Shard(0): torch.chunk's split of dim 0
        offset = min(rank * chunk, rows) * (param.numel() // rows)
        state = optim.state.get(param, {})
        for k, key in enumerate(("param", "exp_avg", "exp_avg_sq")):
            value = param if key == "param" else state.get(key)
            if value is not None:
                total += _part(value.to_local(), offset, 97 * salt + k)
        if rank == 0 and "step" in state:
            total += int(state["step"]) * (salt + 1)
    summed = torch.tensor([total % _PRIME], dtype=torch.int64)
    dist.all_reduce(summed)
    return int(summed) % _PRIME


class Events:
    """Appends one JSON line per event to `path`, with the wall time and who logged it."""

    def __init__(self, path: str, host: int):
        import torch.distributed as dist

        self.path = path
        self.who = {
            "host": host,
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "pid": os.getpid(),
        }

    def log(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "t": time.time(), **self.who, **fields}) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)  # one short write to an O_APPEND file: lines of ranks never interleave


def _max(value: float) -> float:
    """The largest of every rank's `value`, on every rank."""
    import torch
    import torch.distributed as dist

    out = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def _manager(root: str, remote: str | None, async_mode: str | None = None):
    import ckptlib

    return ckptlib.CheckpointManager(
        root,
        keep_last=2,
        cluster=ckptlib.Cluster(replicas=1, remote=remote),
        async_save=ckptlib.AsyncMode(async_mode) if async_mode else False,
    )


def _restore(events: Events, source: str, root: str, args, state: dict, model, optim, step: int) -> None:
    """Load `step` again through a fresh manager on `root`, timed (the slowest rank's time)."""
    import torch.distributed as dist

    mgr = _manager(root, args.remote)
    dist.barrier()
    started = time.perf_counter()
    mgr.load(state, step=step, require=True)
    seconds = _max(time.perf_counter() - started)
    result = mgr.last_load
    mgr.close()
    events.log(
        "restore",
        source=source,
        step=result.step,
        seconds=seconds,
        bytes_by_source=result.bytes_by_source,
        checkpoint_bytes=result.bytes,
        bytes_needed=result.bytes_needed,
        digest=digest(model, optim),
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    events = Events(args.events, args.host)
    events.log("started")
    model, optim = build(args.size_mib)
    state = {"model": model, "optim": optim, "step": 0}
    mgr = _manager(args.root, args.remote)
    events.log("load_start")
    started = time.perf_counter()
    resumed = mgr.load(state)
    seconds = time.perf_counter() - started
    sources = mgr.last_load.bytes_by_source if resumed is not None else {}
    events.log("load_end", step=resumed, seconds=seconds, bytes_by_source=sources)
    first = (resumed or 0) + 1
    for step in range(first, args.max_steps + 1):
        loss = train_step(model, optim, step)
        state["step"] = step
        events.log("step", step=step, loss=loss)
        if step == args.save_step and resumed is None:
            mgr.save(step, state)
            mgr.wait()  # its replicas and its upload are done: the step survives a host
            events.log("saved", step=step, digest=digest(model, optim))
        if resumed is not None:  # the restarted job: its first step is trained
            break
    mgr.close()
    if resumed is not None:
        order = [("peer", args.root), ("remote", args.root + "-empty")]
        for source, root in order if args.rep % 2 == 0 else order[::-1]:
            _restore(events, source, root, args, state, model, optim, resumed)
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(args.root + "-empty", ignore_errors=True)
    events.log("done")
    return 0


def rank_slowdown(base: str, size_mib: int, reps: int, steps: int) -> dict[str, Any]:
    """One rank's step times: per repetition, the modes none / thread / process in a rotating
    order, `steps` timed steps each; a save mode saves every step asynchronously to this node's
    root under `base` (replicas=1), after one untimed step and save (the writer's start-up).
    The last repetition's last save of each mode is loaded back and its digest compared."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    node = int(os.environ["GROUP_RANK"])
    model, optim = build(size_mib)
    state = {"model": model, "optim": optim, "step": 0}
    modes = ("none", "thread", "process")
    times: dict[str, list[list[float]]] = {mode: [] for mode in modes}
    ok, step = True, 0
    for rep in range(reps):
        for mode in modes[rep % 3 :] + modes[: rep % 3]:
            root = f"{base}/rep{rep}-{mode}/node{node}"
            mgr = None if mode == "none" else _manager(root, None, mode)
            step += 1
            train_step(model, optim, step)
            if mgr is not None:
                state["step"] = step
                mgr.save(step, state)
                mgr.wait()
            dist.barrier()
            run_times = []
            for _ in range(steps):
                step += 1
                started = time.perf_counter()
                train_step(model, optim, step)
                if mgr is not None:
                    state["step"] = step
                    mgr.save(step, state)
                run_times.append(time.perf_counter() - started)
            times[mode].append(run_times)
            if mgr is not None:
                mgr.wait()
                if rep == reps - 1:
                    before = digest(model, optim)
                    mgr.load(state, step=step, require=True)
                    ok = ok and digest(model, optim) == before and state["step"] == step
                mgr.close()
                dist.barrier()
                shutil.rmtree(root, ignore_errors=True)
    return {"times": times, "ok": ok}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ckptlib.bench.recovery_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="this host's local root")
    p.add_argument("--remote", required=True, help="the remote every step is uploaded to")
    p.add_argument(
        "--events", required=True, help="the events file (JSON lines); not --log, which torchrun takes for its own"
    )
    p.add_argument("--host", type=int, required=True, help="this host's index (for the events)")
    p.add_argument("--size-mib", type=int, default=64, help="parameters in MiB (layers of 4 MiB)")
    p.add_argument("--save-step", type=int, default=2, help="the one step the first attempt saves")
    p.add_argument("--max-steps", type=int, default=200, help="the first attempt stops here if never killed")
    p.add_argument("--rep", type=int, default=0, help="the repetition: even restores from peers first")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        code = run(args)
        import ckptlib

        ckptlib.exit_barrier()
        return code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
