"""PyTorch Lightning strategies whose checkpoints are ckptlib's: sharded, committed, elastic.

    from ckptlib.integrations.lightning import ModelParallelStrategy
    trainer = L.Trainer(strategy=ModelParallelStrategy(data_parallel_size=4), ...)  # FSDP2 in configure_model
    trainer.fit(model, ckpt_path="last")   # resumes at any world size, from any of these strategies

A Lightning `CheckpointIO` cannot give this: under `ModelParallelStrategy` it is never called,
and under DDP it only sees rank 0's full dict (measured on Lightning 2.6.6). So ckptlib
plugs in one level up, as strategies: `ModelParallelStrategy` (FSDP2/TP, sharded),
`DDPStrategy` and `SingleDeviceStrategy` save through one collective `ckptlib.save` of the
live module and optimizers, and resume through `ckptlib.load`, which reshards onto the
resuming world size and layout. Each checkpoint is a directory in Lightning's own layout
(`state_dict.*`, `optimizer_<i>.*`, plus `meta.pt` with the loops, callbacks and counters,
written by rank 0 after the commit), so Lightning's own `ModelParallelStrategy` resumes from
it too, and these strategies resume from Lightning's (`ckptlib.presets.lightning`). The path
may be an s3://, gs:// or az:// URI. Needs `pip install ckptlib[lightning]`.
"""

from __future__ import annotations

import io
import os
from typing import Any, Mapping

import torch
from lightning.pytorch import strategies

from ckptlib._runtime import agree as _dist
from ckptlib.format.native.layout import classify
from ckptlib.loading.loading import load
from ckptlib.presets.lightning_layout import META
from ckptlib.saving.saving import save
from ckptlib.storage import open_storage


def _optimizers(strategy: Any) -> list[torch.optim.Optimizer]:
    # Lightning may hold LightningOptimizer wrappers; ckptlib pairs the torch optimizers with the module.
    return [getattr(opt, "_optimizer", opt) for opt in strategy.optimizers]


class CkptlibCheckpoints:
    """What the strategies below share: `save_checkpoint` and `load_checkpoint` through
    ckptlib (see the module docstring). Mix it in before a Lightning strategy class."""

    def _ckptlib_state(self, with_optimizers: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"state_dict": self.model}  # type: ignore[attr-defined]
        if with_optimizers:
            state.update({f"optimizer_{i}": opt for i, opt in enumerate(_optimizers(self))})
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        uri = self.broadcast(os.fspath(filepath))  # type: ignore[attr-defined]  # rank 0's path, every rank
        storage = open_storage(uri)
        with_optimizers = "optimizer_states" in checkpoint
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        group = None

        def clear_meta() -> None:
            # meta.pt is the one file ckptlib did not write in a checkpoint it replaces (last.ckpt)
            if _dist.get_rank(group) == 0 and classify(storage) in ("committed", "dcp"):
                storage.delete([META])

        _dist.agree(clear_meta, group)
        save(storage, self._ckptlib_state(with_optimizers), step=checkpoint.get("global_step"), overwrite=True)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        _dist.agree(lambda: storage.write(META, buffer.getvalue()) if _dist.get_rank(group) == 0 else None, group)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        uri = self.broadcast(os.fspath(checkpoint_path))  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        strict = module.strict_loading if module is not None else True
        state = self._ckptlib_state(bool(self.optimizers))  # type: ignore[attr-defined]
        result = load(uri, state, preset="lightning", strict=strict, trusted=weights_only is False)
        return dict(result.metadata)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore once the module is wrapped and the optimizers exist (ckptlib loads both in place)."""
        return True

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: `load_checkpoint` loaded the module in place."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: `load_checkpoint` loaded the optimizers in place."""


class ModelParallelStrategy(CkptlibCheckpoints, strategies.ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` (FSDP2 and tensor parallelism applied in
    `configure_model`), with elastic sharded checkpoints through ckptlib."""


class DDPStrategy(CkptlibCheckpoints, strategies.DDPStrategy):
    """Lightning's `DDPStrategy`, checkpointing through ckptlib (replicated state is written once)."""


class SingleDeviceStrategy(CkptlibCheckpoints, strategies.SingleDeviceStrategy):
    """Lightning's `SingleDeviceStrategy`, checkpointing through ckptlib."""


__all__ = ["CkptlibCheckpoints", "DDPStrategy", "ModelParallelStrategy", "SingleDeviceStrategy"]
