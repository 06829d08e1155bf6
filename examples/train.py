#!/usr/bin/env python3
"""A small FSDP2 training loop with ckptlib's CheckpointManager and autoresume.

    torchrun --nproc-per-node 4 examples/train.py --root /tmp/run --steps 20 --save-every 5 --loss-log /tmp/run.jsonl

Run it again with the same --root (at any world size that divides --batch) and it
resumes from the newest committed checkpoint; the loss curve continues exactly where it
stopped. SIGTERM or SIGUSR1 (to torchrun, or to any one rank) makes every rank save the
step it reached and exit 0: `CheckpointManager(preemption=True)` with `maybe_save`. Under
torchrun's elastic agent, when one host's agent is signalled, the other hosts' ranks exit 75
instead (`mgr.preemption_exit_code()`), so their agents restart them at the smaller size.
See examples/README.md.

Why the loss is bit-identical at every world size: the data of step s is a function of
(seed, s) only, and the global batch is split over the ranks in contiguous chunks. Each
rank computes per-sample losses and gradients one sample at a time (batch-1 kernels, one
thread), the per-sample gradients are all-gathered, and every rank sums them in global
sample order. So the gradient is the same bits on 1, 2, 3 or 4 ranks, unlike an
all-reduce, whose summation order depends on the world size. FSDP2 shards parameters and
AdamW state (what ckptlib checkpoints and reshards); the layers' input widths are
multiples of 32 so every shard is a whole number of SIMD blocks and the elementwise
optimizer math runs through the same kernel path for every element at every world size.
Where FSDP2 cannot run on CPU (torch 2.6: its CPU stream lacks `record_event`) the model is
wrapped in DDP (replicated) instead; the gradient is computed the same way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import ckptlib

IN_DIM, HIDDEN, OUT_DIM = 64, 96, 8  # input widths 64 and 96: multiples of 32 (see above)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_DIM, HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, OUT_DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--root",
        required=True,
        help="checkpoint root (every rank reaches it, or s3://...); with --replicas/--remote: this node's local root",
    )
    p.add_argument("--replicas", type=int, default=0, help="the cluster tier: copies of each node's files on peers")
    p.add_argument("--remote", default=None, help="the cluster tier: the remote root every step is uploaded to")
    p.add_argument("--steps", type=int, default=20, help="train until this step (inclusive)")
    p.add_argument("--save-every", type=int, default=5, help="save a checkpoint every N steps (and at the end)")
    p.add_argument("--keep", type=int, default=2, help="keep the newest N checkpoints")
    # Also spelled --loss-log: torchrun (argparse abbreviations) takes a bare --log after the
    # script name for its own --log-dir/--logs-specs and stops with "ambiguous option".
    p.add_argument(
        "--log",
        "--loss-log",
        dest="log",
        default=None,
        help="append one JSON line per step (rank 0): step, loss, world_size (use --loss-log under torchrun)",
    )
    p.add_argument("--batch", type=int, default=12, help="global batch size (split over the ranks)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wrap",
        choices=["auto", "fsdp2", "ddp"],
        default="auto",
        help="auto: FSDP2 where it trains on CPU with this torch (not 2.6), else DDP",
    )
    p.add_argument("--backend", default="gloo", help="process group backend when torchrun starts us")
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="testing: os._exit(17) on every rank right after the checkpoint of this step",
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="testing: sleep this long after each step")
    p.add_argument("--pause-file", default=None, help="testing: while this file exists, wait before each step")
    return p.parse_args(argv)


def batch(seed: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: a function of (seed, step) only, never of the world size."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(size, IN_DIM, generator=gen)
    y = torch.randn(size, OUT_DIM, generator=gen)
    return x, y


def fsdp2_trains_on_cpu() -> bool:
    """FSDP2 on a CPU mesh records events on `torch.cpu.Stream`, which torch 2.6 lacks."""
    return hasattr(getattr(torch.cpu, "Stream", None), "record_event")


def build(args, rank: int, world: int):
    torch.manual_seed(args.seed)
    model = Net()  # same init on every rank
    wrap = args.wrap
    if wrap == "auto":
        wrap = "fsdp2" if fsdp2_trains_on_cpu() else "ddp"
    if wrap == "fsdp2":
        if not fsdp2_trains_on_cpu():
            raise SystemExit(f"train.py: FSDP2 cannot train on CPU with torch {torch.__version__}: use --wrap ddp")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.inp, mesh=mesh)
        fully_shard(model.out, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    return model, optim, wrap


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of the parameters (an all-gather under FSDP2; exact, no arithmetic)."""
    out = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def train_step(model, optim, replica: Net, step: int, args, rank: int, world: int) -> float:
    """One step; returns the global mean loss (identical bits on every rank)."""
    x, y = batch(args.seed, step, args.batch)
    per_rank = args.batch // world
    lo = rank * per_rank  # this rank's contiguous chunk of the global batch

    with torch.no_grad():
        for name, value in full_params(model).items():
            replica.get_parameter(name).copy_(value)
    names = [name for name, _ in replica.named_parameters()]
    params = [replica.get_parameter(name) for name in names]
    grads, losses = [], []
    for i in range(lo, lo + per_rank):  # one sample at a time: the same kernels on every rank
        loss = (replica(x[i : i + 1]) - y[i : i + 1]).square().mean()
        g = torch.autograd.grad(loss, params)
        grads.append(torch.cat([t.reshape(-1) for t in g]))
        losses.append(loss.detach().reshape(1))
    mine_g = torch.stack(grads)  # [per_rank, n_params]
    mine_l = torch.cat(losses)
    all_g = [torch.empty_like(mine_g) for _ in range(world)]
    all_l = [torch.empty_like(mine_l) for _ in range(world)]
    dist.all_gather(all_g, mine_g)
    dist.all_gather(all_l, mine_l)
    per_sample_g = torch.cat(all_g)  # rank order == global sample order
    per_sample_l = torch.cat(all_l)

    total_g = torch.zeros_like(per_sample_g[0])
    total_l = torch.zeros((), dtype=per_sample_l.dtype)
    for i in range(args.batch):  # a fixed summation order, whatever the world size
        total_g = total_g + per_sample_g[i]
        total_l = total_l + per_sample_l[i]
    mean_g = total_g / args.batch

    pieces = dict(zip(names, mean_g.split([t.numel() for t in params])))
    for name, p in model.named_parameters():
        g_full = pieces[name.removeprefix("module.")].view(p.shape)
        if hasattr(p, "device_mesh"):  # an FSDP2 DTensor shard: take this rank's piece
            from torch.distributed.tensor import distribute_tensor

            p.grad = distribute_tensor(g_full, p.device_mesh, p.placements)
        else:
            p.grad = g_full.clone()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return (total_l / args.batch).item()


def log_line(path: str | None, record: dict) -> None:
    if path is None:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def run(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    torch.set_num_threads(1)  # the per-sample kernels must not split their sums over threads
    model, optim, wrap = build(args, rank, world)
    replica = Net()
    state = {"model": model, "optim": optim, "step": 0}
    tiered = args.replicas or args.remote
    mgr = ckptlib.CheckpointManager(
        args.root,
        keep_last=args.keep,
        save_policy=ckptlib.EveryNSteps(args.save_every) | ckptlib.FinalStep(args.steps),
        preemption=True,
        cluster=ckptlib.Cluster(replicas=args.replicas, remote=args.remote) if tiered else None,
    )

    resumed = mgr.load(state)  # None: nothing to resume, start from step 0
    start = state["step"]
    if rank == 0:
        how = f"resumed from step {resumed}" if resumed is not None else "fresh start"
        if resumed is not None and tiered:
            how += f" (bytes by source {json.dumps(mgr.last_load.bytes_by_source, sort_keys=True)})"
        print(f"train.py: {how}; {world} ranks, {wrap}, torch {torch.__version__}", flush=True)
    for step in range(start + 1, args.steps + 1):
        while args.pause_file and os.path.exists(args.pause_file):
            time.sleep(0.05)
        loss = train_step(model, optim, replica, step, args, rank, world)
        if rank == 0:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's elastic agent
            log_line(args.log, {"step": step, "loss": loss, "world_size": world, "wrap": wrap, "restart": restart})
        state["step"] = step
        saved = mgr.maybe_save(step, state, metrics={"loss": loss}, metadata={"world_size": world, "wrap": wrap})
        if saved and step == args.crash_at_step:  # every rank returned from the save: it is committed
            dist.barrier()
            sys.stdout.flush()
            os._exit(17)
        if mgr.preempted:  # every rank saw it in maybe_save, and the step is committed
            code = mgr.preemption_exit_code()  # 75 under an elastic agent on a host not preempted
            if rank == 0 or (code and os.environ.get("LOCAL_RANK") == "0"):
                print(
                    f"train.py: {mgr.preemption_signal or 'a preemption signal'} received; saved step {step}, exiting"
                    + (f" with {code} (another host was preempted: the agent restarts this one)" if code else ""),
                    flush=True,
                )
            mgr.close()
            return code
        if args.step_delay:
            time.sleep(args.step_delay)
    mgr.close()
    if rank == 0:
        print(
            f"train.py: done at step {args.steps}, loss {loss if args.steps > start else float('nan'):.6f}", flush=True
        )
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.crash_at_step is not None and args.crash_at_step % args.save_every and args.crash_at_step != args.steps:
        raise SystemExit("--crash-at-step must be a step that saves (a multiple of --save-every)")
    own_group = not dist.is_initialized()
    if own_group and "RANK" in os.environ:  # under torchrun (the test launcher makes its own group)
        dist.init_process_group(args.backend, timeout=datetime.timedelta(minutes=5))
    elif own_group:  # plain `python examples/train.py`: a group of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        code = run(args)
        if own_group:  # no rank tears gloo down while a peer still reads the last save's bytes
            ckptlib.exit_barrier()
        return code
    finally:
        if own_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
