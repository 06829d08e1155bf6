"""torchtitan 0.3.0 does not resume its data loader at another data-parallel size.

torchtitan's ``ParallelAwareDataloader`` saves its state under ``dp_rank_<r>`` plus the saved
``world_size``, and its ``CheckpointManager`` loads it like any other state. At a smaller DP size
the load asserts "dp_degree is inconsistent before and after checkpoint, dataloader resharding
is not supported yet"; at a larger one the new ranks ask DCP for a ``dp_rank_<r>`` key the
checkpoint does not have and the load fails on every rank. (torchtitan's own answer is
``checkpoint.exclude_from_loading=["dataloader"]``: the data restarts from the beginning.)

    torchrun --nproc-per-node 2 examples/conformance/torchtitan_dataloader_resize.py save /tmp/tt
    torchrun --nproc-per-node 1 examples/conformance/torchtitan_dataloader_resize.py load /tmp/tt
    torchrun --nproc-per-node 3 examples/conformance/torchtitan_dataloader_resize.py load /tmp/tt

Each rank prints (and, with CKPTLIB_RESULT_DIR set, writes to rank<r>.json) what happened:
``{"loaded": true}`` or the exception's type and first line. Needs torchtitan (CPU, gloo).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset


class Numbers(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor([i]) for i in range(100))


def manager(root: str):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer.optimizer import default_adamw

    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.Linear(2, 2)
    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"
    optimizers = config.build(model_parts=[model])
    loader = ParallelAwareDataloader(Numbers(), dp_rank=rank, dp_world_size=world, batch_size=2)
    cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0)
    mgr = CheckpointManager(
        cfg,
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=None,
        states={},
        sd_adapter=None,
        base_folder=root,
    )
    return mgr, loader


def main() -> None:
    mode, root = sys.argv[1], os.path.abspath(sys.argv[2])
    dist.init_process_group("gloo")
    mgr, loader = manager(root)
    if mode == "save":
        batches = iter(loader)
        next(batches), next(batches)  # the loader has moved on: its position is worth saving
        mgr.save(curr_step=1)
        outcome = {"saved": True}
    else:
        try:
            outcome = {"loaded": mgr.load(step=-1)}
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            lines = str(exc).strip().splitlines()
            cause = [line.strip() for line in lines if "Error:" in line]  # a CheckpointException's ranks' errors
            outcome = {"error": type(exc).__name__, "message": (cause or lines)[-1]}
    mgr.close()
    outcome["world"] = dist.get_world_size()
    print(json.dumps(outcome))
    results = os.environ.get("CKPTLIB_RESULT_DIR")
    if results:
        with open(os.path.join(results, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(outcome, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
