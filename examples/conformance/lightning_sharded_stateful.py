"""Lightning 2.6.6 (Fabric): a sharded checkpoint's load does not restore stateful objects.

``fabric.save(path, {"model": ..., "optimizer": ..., "scheduler": scheduler})`` with
``ModelParallelStrategy`` (FSDP2; ``save_distributed_checkpoint=True``, the default) writes the
scheduler's state into ``meta.pt``. ``fabric.load(path, state)`` restores the model and the
optimizer, but for the scheduler it replaces ``state["scheduler"]`` with the saved *dict*
(``state[key] = metadata.pop(key)`` in ``_load_checkpoint``) instead of calling
``scheduler.load_state_dict``: the scheduler object keeps its fresh state, and code that goes on
using it (as a training loop does) resumes with the wrong learning-rate schedule. The full-file
checkpoint (``save_distributed_checkpoint=False``) does call ``load_state_dict``. Lightning's
``FSDPStrategy`` has the same line in its sharded load (``fsdp.py``), but it is FSDP1 and does not
start on CPU at all (mode ``fsdp``).

    torchrun --nproc-per-node 2 examples/conformance/lightning_sharded_stateful.py sharded /tmp/lt
    torchrun --nproc-per-node 2 examples/conformance/lightning_sharded_stateful.py full /tmp/lt
    torchrun --nproc-per-node 2 examples/conformance/lightning_sharded_stateful.py fsdp /tmp/lt

Each rank prints (and, with CKPTLIB_RESULT_DIR set, writes to rank<r>.json): the type of
``state["scheduler"]`` after the load and whether the scheduler object holds the saved state.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn


def shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def build(fabric, seed: int):
    torch.manual_seed(seed)
    model = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def report(fabric, outcome: dict) -> None:
    outcome["world"] = int(os.environ.get("WORLD_SIZE", 1)) if fabric is None else fabric.world_size
    print(json.dumps(outcome))
    results = os.environ.get("CKPTLIB_RESULT_DIR")
    if results:
        rank = int(os.environ.get("RANK", 0)) if fabric is None else fabric.global_rank
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump(outcome, f)


def main() -> None:
    mode, root = sys.argv[1], os.path.abspath(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", 1))
    if mode == "fsdp":
        try:
            L.Fabric(accelerator="cpu", devices=world, strategy=FSDPStrategy())
            outcome = {"setup": "ok"}
        except Exception as exc:  # noqa: BLE001 - the outcome is what this script reports
            outcome = {"error": type(exc).__name__, "message": str(exc).strip().splitlines()[0]}
        report(None, outcome)
        return
    strategy = ModelParallelStrategy(parallelize_fn=shard, save_distributed_checkpoint=(mode == "sharded"))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    state = build(fabric, 0)
    for _ in range(3):
        state["model"](torch.randn(2, 4)).sum().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    saved = state["scheduler"].state_dict()
    path = os.path.join(root, f"{mode}.ckpt")
    fabric.save(path, state)

    state = build(fabric, 1)
    scheduler = state["scheduler"]
    fabric.load(path, state)
    report(
        fabric,
        {
            "entry_after_load": type(state["scheduler"]).__name__,
            "entry_is_saved_state": state["scheduler"] == saved,
            "scheduler_restored": scheduler.state_dict() == saved,
        },
    )


if __name__ == "__main__":
    main()
