"""Save a ckptlib checkpoint that MosaicML Composer autoresumes from.

    from ckptlib.presets import composer_save
    composer_save.save("runs/tiny", trainer.state)   # every rank; e.g. from a Callback's batch_checkpoint

writes `runs/tiny/ep{epoch}-ba{batch}/` (a committed ckptlib checkpoint: DCP + manifest, so
Composer's own reader reads it) holding Composer's `State.state_dict()` under `state` and
every rank's RNG state under `rng` (`rng.<rank>.{python,numpy,torch[,cuda]}`), exactly as
Composer's sharded checkpoints hold them, then points `latest-rank0.pt` at it (a relative
symlink, written by rank 0 after the commit; in an object store the `.symlink` object Composer
reads there). `Trainer(autoresume=True, save_folder="runs/tiny", run_name=...)` then resumes
from it at any world size: the timestamp, model, optimizer, schedulers and RNG state.
"""

from __future__ import annotations

import os
import random
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from ckptlib._runtime import agree as _dist
from ckptlib.errors import StateError
from ckptlib.presets.composer_layout import POINTER, REMOTE_POINTER
from ckptlib.saving.saving import SaveResult
from ckptlib.saving.saving import save as ckptlib_save
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage


def rng_state() -> dict[str, Any]:
    """This rank's RNG state as Composer's `reproducibility.get_rng_state` records it."""
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def rng_states(group=None) -> list[dict[str, Any]]:
    """Every rank's `rng_state()`, in rank order (each rank holds all; the save writes them once)."""
    mine = rng_state()
    if not _dist.is_distributed():
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


class _ComposerState:
    """Composer's `State` as ckptlib saves it: its `state_dict()`, plus the (empty) record of
    Composer's own checkpoints a resuming trainer with a save folder asks for."""

    def __init__(self, state: Any):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        out = dict(self.state.state_dict())
        callbacks = dict(out.get("callbacks") or {})
        callbacks.setdefault("CheckpointSaver", {"all_saved_checkpoints_to_timestamp": []})
        out["callbacks"] = callbacks
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # pragma: no cover - saving only
        raise StateError("load a Composer checkpoint with Composer's autoresume, or ckptlib.load(preset='composer')")


def folder_name(state: Any) -> str:
    """`ep{epoch}-ba{batch}`, Composer's default sharded checkpoint name, from its timestamp."""
    timestamp = getattr(state, "timestamp", None)
    if timestamp is None or not hasattr(state, "state_dict"):
        raise StateError(f"expected Composer's State (trainer.state), got {type(state).__name__}")
    return f"ep{int(timestamp.epoch.value)}-ba{int(timestamp.batch.value)}"


def write_pointer(root: Storage, name: str) -> None:
    """Point `latest-rank0.pt` at `name`: a relative symlink replaced atomically (local), or
    the `.symlink` object naming it (object store)."""
    local = root.local_path(POINTER)
    if local is None:
        root.write(REMOTE_POINTER, name.encode("utf-8"))
        return
    tmp = f"{local}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, local)


def save(
    save_folder: str | os.PathLike | Storage,
    state: Any,
    *,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    process_group=None,
) -> SaveResult:
    """Save Composer's `state` (a `composer.core.State`, e.g. `trainer.state`) into
    `save_folder` in Composer's sharded layout; collective (every rank). Returns the save's
    SaveResult (its step is the timestamp's batch)."""
    root = as_storage(save_folder)
    name = folder_name(state)
    entries = {"state": _ComposerState(state), "rng": rng_states(process_group)}
    step = int(state.timestamp.batch.value)
    result = ckptlib_save(
        root.child(name), entries, step=step, metadata=metadata, overwrite=overwrite, process_group=process_group
    )
    rank = _dist.get_rank(process_group)
    # every rank returns once the pointer is in place (or raises rank 0's failure to write it)
    _dist.agree(lambda: write_pointer(root, name) if rank == 0 else None, process_group)
    return result


__all__ = ["folder_name", "rng_state", "rng_states", "save", "write_pointer"]
