"""Hugging Face Accelerate's checkpoints behind the harness's protocol: ``Accelerator.save_state``
/ ``load_state`` with FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``, sharded state
dict: the model in ``pytorch_model_fsdp_0/`` and the optimizer in ``optimizer_0/``, both DCP) and
automatic checkpoint naming (``ROOT/checkpoints/checkpoint_<iteration>``; ``load_state()``
resumes the highest-numbered folder). The adapter sets the iteration to the step before each
save, so the folder is ``checkpoint_<step>``.

Built by hand where Accelerate cannot run on CPU: Accelerate turns FSDP on only for
accelerator device types (its ``AcceleratorState`` leaves a CPU launch ``MULTI_CPU`` even with an
FSDP plugin, and ``prepare`` would then wrap the model in DDP). The adapter sets the state's
distributed type to FSDP and registers the harness's already sharded model and its optimizers
the way ``prepare`` does (``_models``, ``_optimizers``), so ``save_state``/``load_state`` run
their FSDP2 path as on a GPU launch. examples/conformance/accelerate_cpu_fsdp.py shows the
unpatched CPU path: ``save_state`` writes one ``model.safetensors`` from rank 0 alone.

``save_state`` returns on a rank while another may still be writing its own files (no barrier
after ``random_states_<rank>.pkl``); the adapter waits for every process after it, as
Accelerate's documentation has users do.

What it carries: the model, the optimizers (paired by index with the model, as Accelerate
does), every other object with a state dict that is the same on every rank (schedulers and
extras, through ``register_for_checkpointing``: ``custom_checkpoint_<i>.pkl`` from the main
process) and the plain values (``step``, one more registered object). What it does not:
per-rank state (``ckptlib.RankLocal``). Accelerate saves each process's global RNG
(``random_states_<rank>.pkl``), which restores python/numpy/torch RNG at the same world size
only: at a larger one the new ranks find no file and keep their RNG, logged at INFO level
("Could not load random states"), and at a smaller one the missing ranks' files are ignored.

Reference: ``ckptlib.testing.checkpointers:accelerate`` (or this module's ``AccelerateCheckpointer``).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptlib.testing.checkpointers.adapter_state import (
    Carries,
    Values,
    every_entry_but_per_rank,
    package_version,
    parts,
)

FOLDER = re.compile(r"^checkpoint_(\d+)$")


class AccelerateCheckpointer:
    """``Accelerator.save_state``/``load_state`` with FSDP2 and automatic checkpoint naming."""

    name = "accelerate"

    def __init__(self) -> None:
        self._accelerator: Any = None
        self.carries = Carries(every_entry_but_per_rank)  # every entry but the per-rank ones

    @property
    def version(self) -> str | None:
        return package_version("accelerate")

    def where(self, root: str) -> str:
        return os.path.join(root, "checkpoints")

    def _accelerator_for(self, root: str, state: dict[str, Any], values: Values, iteration: int) -> Any:
        self.carries.note(state)
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ProjectConfiguration

        if self._accelerator is None:  # one per process: Accelerate's state is a process-wide singleton
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
            self._accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
            self._accelerator.state.distributed_type = DistributedType.FSDP
            self._accelerator.state.fsdp_plugin = plugin
        accelerator = self._accelerator
        accelerator.project_configuration = ProjectConfiguration(
            project_dir=root, automatic_checkpoint_naming=True, iteration=iteration
        )
        p = parts(state, self.name)
        accelerator._models = [p.model]
        accelerator._optimizers = list(p.optimizers.values())
        accelerator._schedulers = []
        accelerator._dataloaders = []
        accelerator._custom_objects = [*p.stateful.values(), values]
        return accelerator

    def newest(self, root: str) -> int | None:
        """The highest ``checkpoint_<N>`` under `root`/checkpoints, as load_state() picks it."""
        folder = self.where(root)
        if not os.path.isdir(folder):
            return None
        return max((int(m.group(1)) for m in map(FOLDER.match, os.listdir(folder)) if m), default=None)

    def save(self, root: str, step: int, state: dict[str, Any]) -> None:
        values = Values({**parts(state, self.name).values, "step": step})
        accelerator = self._accelerator_for(root, state, values, step)
        accelerator.save_state()
        # save_state has no barrier after each process's own files (random_states_<rank>.pkl):
        # it returns on one rank while another still writes. Accelerate's docs wait for everyone.
        accelerator.wait_for_everyone()

    def load(self, root: str, state: dict[str, Any]) -> int | None:
        import torch.distributed as dist

        found = [self.newest(root)]
        if dist.is_initialized():  # Accelerate raises on a root without checkpoints: every rank agrees
            dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        values = Values({**parts(state, self.name).values, "step": None})
        self._accelerator_for(root, state, values, 0).load_state()
        values.restore(state)
        return values.values["step"]


__all__ = ["AccelerateCheckpointer"]
