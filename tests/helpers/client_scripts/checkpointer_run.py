"""The adapters of other tools' checkpointers (ckptlib.testing.checkpointers: torchtitan,
lightning, accelerate) against the real packages (issue 48.2). Under torchrun (gloo, CPU):

    checkpointer_run.py save ROOT ADAPTER   a tiny MLP, FSDP2 over every rank (also at 1), AdamW and a
                                            StepLR take 2 steps, ADAPTER saves step 2 under ROOT/ADAPTER,
                                            one more step, ADAPTER saves step 3 (plain values: step, epoch).
                                            Rank 0 writes the full state to ROOT/expected.pt.
    checkpointer_run.py save-async ROOT ADAPTER   the same through ADAPTER.async_save, training one more step
                                            while each save is in flight (the step saved is the one before)
    checkpointer_run.py load ROOT ADAPTER   a fresh build from another seed loads through ADAPTER and
                                            reports the step it returned, state["step"], the model's and
                                            the optimizer's differences from ROOT/expected.pt, the
                                            scheduler's state, whether this rank's torch RNG is the one the
                                            same rank had at the save, and what the adapter promised to carry.
    checkpointer_run.py fresh ROOT ADAPTER  load from an empty root: the step it returned
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
from client_common import differences, finish, full_state, init_gloo, rank, report, world
from torch import nn

from ckptlib.testing.checkpointers import resolve

warnings.filterwarnings("ignore")
STEPS = 3


def build(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "step": -1, "epoch": 0}


def group_keys(state) -> list[list[str]]:
    """The keys of each of the optimizer's param groups (an adapter must leave them as they were)."""
    return [sorted(group) for group in state["optim"].param_groups]


def train(state, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        nn.functional.cross_entropy(state["model"](x), y).backward()
        state["optim"].step()
        state["optim"].zero_grad()
        state["sched"].step()


def save(checkpointer, where: str, step: int, state, background: bool) -> None:
    """Save `step`; in the background, train on (changing every parameter and the optimizer's
    state in place) while the save is in flight, then wait for it."""
    if not background:
        checkpointer.save(where, step, state)
        return
    pending = checkpointer.async_save(where, step, state)
    train(state, 1)
    pending.wait()


def main() -> None:
    mode, root, ref = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3]
    init_gloo()
    checkpointer = resolve(f"ckptlib.testing.checkpointers:{ref}")
    where = os.path.join(root, ref)
    expected_path = os.path.join(root, "expected.pt")
    if mode in ("save", "save-async"):
        background = mode == "save-async"
        state = build(0)
        groups = group_keys(state)
        train(state, STEPS - 1)
        state["step"], state["epoch"] = STEPS - 1, 1
        save(checkpointer, where, STEPS - 1, state, background)  # an older step: the load must resume the newest
        train(state, 1)
        state["step"], state["epoch"] = STEPS, 2
        rngs: list = [None] * world()
        dist.all_gather_object(rngs, torch.get_rng_state())
        expected = {**full_state(state["model"], state["optim"]), "sched": state["sched"].state_dict(), "rng": rngs}
        save(checkpointer, where, STEPS, state, background)
        if rank() == 0:
            torch.save(expected, expected_path)
        files = sorted(os.path.relpath(os.path.join(d, f), where) for d, _, fs in os.walk(where) for f in fs)
        report(
            files=files if rank() == 0 else [],
            world=world(),
            version=checkpointer.version,
            groups_unchanged=group_keys(state) == groups,
        )
    elif mode == "load":
        state = build(1)
        groups = group_keys(state)
        fresh_sched = dict(state["sched"].state_dict())
        carries = sorted(checkpointer.carries(state))
        step = checkpointer.load(where, state)
        expected = torch.load(expected_path, weights_only=False)
        got = full_state(state["model"], state["optim"])
        sched = state["sched"]
        report(
            step=step,
            state_step=state["step"],
            state_epoch=state["epoch"],
            groups_unchanged=group_keys(state) == groups,
            model=differences(expected["model"], got["model"]),
            optim=differences(expected["optim"], got["optim"]),
            sched_restored=sched.state_dict() == expected["sched"] if hasattr(sched, "state_dict") else None,
            sched_fresh=sched.state_dict() == fresh_sched if hasattr(sched, "state_dict") else None,
            sched_entry=type(sched).__name__,
            rng_restored=rank() < len(expected["rng"]) and torch.equal(torch.get_rng_state(), expected["rng"][rank()]),
            carries=carries,
            world=world(),
        )
    else:
        state = build(1)
        report(step=checkpointer.load(where, state), state_step=state["step"], world=world())
    finish()


if __name__ == "__main__":
    main()
