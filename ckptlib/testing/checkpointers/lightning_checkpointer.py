"""Lightning's sharded checkpoint behind the harness's protocol: Fabric's
``ModelParallelStrategy.save_checkpoint`` / ``load_checkpoint`` (``save_distributed_checkpoint=True``:
a folder holding a DCP checkpoint of the model and the optimizers, plus ``meta.pt``, the rest of
the state, written by rank 0 after the shards).

Why not ``FSDPStrategy``: Lightning's ``FSDPStrategy`` (Fabric's and the Trainer's) is FSDP1
(``FullyShardedDataParallel``): it refuses to start on CPU ("FSDP is only available on GPU";
examples/conformance/lightning_sharded_stateful.py, mode ``fsdp``), and it only recognises FSDP1
modules, so it could not save the harness's FSDP2 model anyway. ``ModelParallelStrategy`` is
Lightning's FSDP2 strategy and writes the same sharded layout through the same code
(``_distributed_checkpoint_save`` plus ``meta.pt``).

The adapter calls the strategy as ``Fabric.save``/``Fabric.load`` do, with their barrier after
each. Fabric has no "resume the newest" of its own (the user names the checkpoint path); the adapter
saves step N to ``ROOT/step=N.ckpt`` (ModelCheckpoint's ``step=`` naming) and loads the highest
N whose folder holds ``meta.pt`` (the file Lightning writes last).

What it carries: the model, the optimizers and plain values (``step``). What it does not:
- objects with a state dict (schedulers, stateful extras): Lightning saves their state in
  ``meta.pt``, but the sharded load *replaces* the state mapping's entry with the saved dict
  (``state[key] = metadata.pop(key)``) instead of calling the object's ``load_state_dict``, so
  the object itself keeps its fresh state (the full-file path does call it);
  examples/conformance/lightning_sharded_stateful.py reproduces it. The adapter hands Lightning
  a copy of the mapping, so the harness's objects are left as Lightning leaves them: unrestored.
- per-rank state (``ckptlib.RankLocal``): ``meta.pt`` is rank 0's alone.

Reference: ``ckptlib.testing.checkpointers:lightning`` (or this module's ``LightningCheckpointer``).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptlib.testing.checkpointers.adapter_state import Carries, package_version, parts

STEP_DIR = re.compile(r"^step=(\d+)\.ckpt$")
META = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


class LightningCheckpointer:
    """Fabric's ``ModelParallelStrategy`` sharded checkpoints, one folder per step."""

    name = "lightning"

    def __init__(self) -> None:
        self.carries = Carries(self._carried)

    def _carried(self, state: dict[str, Any]) -> frozenset[str]:
        """The model, the optimizers and the plain values (see the module docstring)."""
        p = parts(state, self.name)
        return frozenset({p.model_name, *p.optimizers, *p.values})

    @property
    def version(self) -> str | None:
        return package_version("lightning")

    def where(self, root: str) -> str:
        return root

    def _strategy(self) -> Any:
        import torch.distributed as dist
        from lightning.fabric.plugins.environments import LightningEnvironment
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize_fn=lambda module, _mesh: module, save_distributed_checkpoint=True)
        environment = LightningEnvironment()
        environment.set_world_size(dist.get_world_size() if dist.is_initialized() else 1)
        environment.set_global_rank(dist.get_rank() if dist.is_initialized() else 0)
        strategy.cluster_environment = environment
        return strategy

    def _mapping(self, state: dict[str, Any], step: int | None) -> dict[str, Any]:
        self.carries.note(state)
        p = parts(state, self.name)
        values = dict(p.values)
        values["step"] = step
        return {p.model_name: p.model, **p.optimizers, **p.stateful, **values}

    def save(self, root: str, step: int, state: dict[str, Any]) -> None:
        mapping = self._mapping(state, step)
        strategy = self._strategy()
        strategy.save_checkpoint(os.path.join(root, f"step={step}.ckpt"), mapping)
        strategy.barrier()  # as Fabric.save does: rank 0 writes meta.pt after the collective save

    def newest(self, root: str) -> int | None:
        """The highest step under `root` whose folder holds Lightning's ``meta.pt``."""
        if not os.path.isdir(root):
            return None
        steps = [
            int(m.group(1))
            for m in map(STEP_DIR.match, os.listdir(root))
            if m and os.path.isfile(os.path.join(root, m.group(0), META))
        ]
        return max(steps, default=None)

    def load(self, root: str, state: dict[str, Any]) -> int | None:
        import torch.distributed as dist

        found = [self.newest(root)]
        if dist.is_initialized():  # every rank loads the step rank 0 found
            dist.broadcast_object_list(found, src=0)
        step = found[0]
        if step is None:
            return None
        mapping = self._mapping(state, None)
        strategy = self._strategy()
        strategy.load_checkpoint(os.path.join(root, f"step={step}.ckpt"), mapping)
        strategy.barrier()  # as Fabric.load does
        for key in parts(state, self.name).values:
            state[key] = mapping[key]
        return mapping["step"]


__all__ = ["LightningCheckpointer"]
