"""MosaicML Composer's sharded checkpoints (measured on Composer 0.32.1, FSDP2
`state_dict_type="sharded"`).

A save folder holds one DCP directory per checkpoint, `ep{epoch}-ba{batch}`, and
`latest-rank0.pt`, a relative symlink to the newest one written by rank 0 (an object store
holds `latest-rank0.pt.symlink`, a small object naming it). Keys:

    state.model.<fqn>                         the model (-> "model.<fqn>")
    state.optimizers.<OptimizerClass>.<...>   the optimizer, nested as get_optimizer_state_dict (-> "optim.<...>")
    state.schedulers.<Class>.*, state.timestamp.Timestamp.*, state.run_name, state.rank_zero_seed,
    state.metadata.*, state.algorithms, state.callbacks.*, state.dataset_state.*
    rng.<rank>.{python,numpy,torch[,cuda]}    every rank's RNG state, saved once

Its objects are plain data: `datetime.timedelta` (wall-clock times), numpy's MT19937 state,
`torch.torch_version.TorchVersion`; those (and only those) unpickle without `trusted=True`.
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any

import numpy as np
import torch

from ckptlib.format.native.root import StepInfo
from ckptlib.presets.preset import Entries, Preset, Rename, read_objects
from ckptlib.storage.base import Storage

POINTER = "latest-rank0.pt"
REMOTE_POINTER = POINTER + ".symlink"
_OPTIMIZER_RE = re.compile(r"^state\.optimizers\.[^.]+\.")
TIMESTAMP = "state.timestamp.Timestamp."


def _numpy_globals() -> list:
    """numpy's array-rebuilding function (under numpy 2's module name and numpy 1's) and the
    classes an MT19937 state holds."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype("uint32")),
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
    ]


class ComposerPreset(Preset):
    name = "composer"
    client = "MosaicML Composer 0.32 (sharded state_dict_type)"
    folder_re = re.compile(r"^ep(?P<epoch>\d+)-ba(?P<step>\d+)$")

    def newness(self, info: StepInfo) -> tuple:
        """The batch (the step), then the epoch: Composer names its epoch-end save of batch B
        `ep{E+1}-ba{B}`, after an `ep{E}-ba{B}` of the same batch."""
        match = self.folder_re.match(info.name)
        return (info.step, int(match.group("epoch")) if match else 0)

    def latest(self, root: Storage) -> str | None:
        """What `latest-rank0.pt` names (a symlink, or the object store's `.symlink` object),
        else the newest complete `ep*-ba*` folder."""
        local = root.local_path(POINTER)
        target = None
        if local is not None and os.path.islink(local):
            target = os.readlink(local)
        else:
            try:
                target = root.read(REMOTE_POINTER).decode("utf-8").strip()
            except (FileNotFoundError, UnicodeDecodeError):
                target = None
        if target:
            name = target.rstrip("/").rsplit("/", 1)[-1]
            if os.path.isabs(target) and local is not None:
                name = os.path.relpath(target, root.local_path())
            if name and name in root.list_children():
                return name
        return super().latest(root)

    def looks_like_root(self, root: Storage) -> bool:
        local = root.local_path(POINTER)
        if local is not None and os.path.islink(local):
            return True
        return super().looks_like_root(root)

    def rename(self, entries: Entries) -> Rename:
        model = entries.model + "."
        optim = entries.optimizer(0) + "."

        def rename(key: str) -> str:
            if key.startswith("state.model."):
                return model + key[len("state.model.") :]
            match = _OPTIMIZER_RE.match(key)
            if match:
                return optim + key[match.end() :]
            return key

        return rename

    def model_name(self, key: str) -> str | None:
        return key[len("state.model.") :] if key.startswith("state.model.") else None

    def safe_globals(self) -> list:
        return [datetime.timedelta, torch.torch_version.TorchVersion, *_numpy_globals()]

    def progress(self, storage: Storage, *, trusted: bool) -> tuple[int | None, dict[str, Any]]:
        """The timestamp Composer saved (`batch` is the step), its run name and seed."""
        names = ("state.run_name", "state.rank_zero_seed")
        with self.allowing():
            found = read_objects(storage, lambda k: k.startswith(TIMESTAMP) or k in names, trusted=trusted)
        timestamp = {k[len(TIMESTAMP) :]: v for k, v in found.items() if k.startswith(TIMESTAMP)}
        out: dict[str, Any] = {"timestamp": timestamp} if timestamp else {}
        for key in names:
            if key in found:
                out[key.split(".", 1)[1]] = found[key]
        step = timestamp.get("batch")
        if not isinstance(step, int):
            match = self.folder_re.match(os.path.basename(storage.uri.rstrip("/")))
            step = int(match.group("step")) if match else None
        return step, out


__all__ = ["POINTER", "ComposerPreset"]
