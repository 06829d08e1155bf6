"""Accelerate 1.16.0 ignores an FSDP plugin on CPU: the FSDP2 checkpoint path cannot run there.

``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` under a
2-process launch leaves the distributed type ``MULTI_CPU`` (``AcceleratorState`` turns FSDP on
only for accelerator device types), ``prepare`` wraps the model in DDP instead of sharding it,
and ``save_state`` writes whole-model files from the main process (``model.safetensors``,
``optimizer.bin``) rather than the sharded ``pytorch_model_fsdp_0/`` and ``optimizer_0/``. To
prove Accelerate's FSDP2 checkpoints on CPU, ``ckptlib.testing.checkpointers:accelerate`` sets the
distributed type to FSDP by hand, as a GPU launch would.

    torchrun --nproc-per-node 2 examples/conformance/accelerate_cpu_fsdp.py /tmp/acc

Each rank prints (and, with CKPTLIB_RESULT_DIR set, writes to rank<r>.json) the distributed
type, the prepared model's class and the files ``save_state`` wrote.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn


def main() -> None:
    root = os.path.abspath(sys.argv[1])
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    out = os.path.join(root, "checkpoint")
    accelerator.save_state(out)
    accelerator.wait_for_everyone()
    outcome = {
        "distributed_type": str(accelerator.distributed_type),
        "model": type(model).__name__,
        "files": sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs),
        "world": accelerator.num_processes,
    }
    print(json.dumps(outcome))
    results = os.environ.get("CKPTLIB_RESULT_DIR")
    if results:
        with open(os.path.join(results, f"rank{accelerator.process_index}.json"), "w") as f:
            json.dump(outcome, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
