"""A torchtitan checkpoint manager that saves and loads through ckptlib.

    from ckptlib.integrations.torchtitan import CheckpointManager
    config = Trainer.Config(..., checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", interval=500))

torchtitan (0.3) builds its checkpointer from `Trainer.Config.checkpoint`, and `Config.build()`
constructs the class that declares the nested Config: this subclass of torchtitan's own
`CheckpointManager` declares one, and replaces only the two places that write and read DCP
(`dcp_save`, `dcp_load`). Everything else stays torchtitan's: the `step-N` folders, the state
it saves (the model's keys at the top level, `optimizer`, `lr_scheduler`, `dataloader`,
`train_state`), intervals, `keep_latest_k`, model-only last steps, HF export. What ckptlib
adds: each step is committed (a manifest written last, checksums verified on load), the save
refuses nothing torchtitan would overwrite, async saves run in ckptlib's background save,
the folders may be s3://, gs:// or az:// URIs, and the checkpoints stay plain DCP that
torchtitan's own manager (and `ckptlib.load(..., preset="torchtitan")`) reads at any world
size. Needs `pip install ckptlib[torchtitan]`.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import dcp as titan_dcp

from ckptlib.loading.loading import load
from ckptlib.saving.saving import async_save, save


class _Pending(Future):
    """What torchtitan waits on (`.result()`) for an async save: ckptlib's AsyncSave handle."""

    def __init__(self, handle: Any):
        super().__init__()
        self.handle = handle

    def result(self, timeout: float | None = None) -> Any:
        return self.handle.wait()


class _Stateful:
    """One of torchtitan's stateful containers as ckptlib saves it: through its own
    state_dict/load_state_dict (its OptimizersContainer is an Optimizer whose flat state dict
    already names every parameter; ckptlib must not pair it with a module)."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


def _wrapped(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _Stateful(v) if callable(getattr(v, "state_dict", None)) and not isinstance(v, torch.Tensor) else v
        for k, v in state_dict.items()
    }


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


class CheckpointManager(titan_dcp.CheckpointManager):
    """torchtitan's CheckpointManager, writing and reading each step through ckptlib."""

    @dataclass(kw_only=True, slots=True)
    class Config(titan_dcp.CheckpointManager.Config):
        verify: bool = True
        """Check every byte read against the manifest's checksums on load."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.verify = config.verify

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: titan_dcp.AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        if to_hf:  # Hugging Face safetensors through torchtitan's own writer
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        step = self._step_of(checkpoint_id)
        state = _wrapped(state_dict)
        if async_mode == titan_dcp.AsyncMode.DISABLED:
            save(checkpoint_id, state, step=step, overwrite=True)
            return None
        pending = _Pending(async_save(checkpoint_id, state, step=step, overwrite=True))
        if async_mode == titan_dcp.AsyncMode.ASYNC_WITH_PINNED_MEM:
            return AsyncSaveResponse(staging_completion=_done(), upload_completion=pending)
        return pending

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        state = _wrapped(state_dict)
        load(checkpoint_id, state, verify=self.verify)
        state_dict.update({k: v for k, v in state.items() if not isinstance(v, _Stateful)})
        if titan_dcp.MODEL in self.states:  # torchtitan flattens the model's keys into the state: apply them
            self.states[titan_dcp.MODEL].load_state_dict(state_dict)

    def _step_of(self, checkpoint_id: str) -> int | None:
        name = str(checkpoint_id).rstrip("/").rsplit("/", 1)[-1]
        return int(name[len("step-") :]) if name.startswith("step-") and name[len("step-") :].isdigit() else None


__all__ = ["CheckpointManager"]
