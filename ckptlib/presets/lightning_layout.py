"""PyTorch Lightning's checkpoints (measured on Lightning 2.6.6).

`ModelParallelStrategy` (and ckptlib's Lightning strategies) write a *directory* named like
a file, `epoch=<E>-step=<S>.ckpt` (and `last.ckpt`): a DCP checkpoint of

    state_dict.<fqn>                  the LightningModule's state (-> "model.<fqn>")
    optimizer_<i>.state.<fqn>.<slot>  each optimizer, nested as torch's get_optimizer_state_dict
    optimizer_<i>.param_groups.<g>.*  (-> "optim.<...>" for the first)

plus `meta.pt` (torch.save, written by rank 0 after the DCP save): everything else of the
Lightning checkpoint dict: `epoch`, `global_step`, `loops` (the progress counters),
`callbacks`, `lr_schedulers`, `hyper_parameters`, `pytorch-lightning_version`. Lightning needs
`meta.pt` to load the directory; a load with this preset reports it (`LoadResult.step` is
`global_step`, `LoadResult.metadata` holds meta.pt). The single-file `.ckpt` other strategies
write (a torch.save of the whole dict) is read with the same keys.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any

import torch

from ckptlib.errors import CheckpointCorruptError, UnsafeCheckpointError
from ckptlib.presets.preset import Entries, Preset, Rename, read_objects
from ckptlib.storage.base import Storage, root_is_file

META = "meta.pt"
_OPTIMIZER_RE = re.compile(r"^optimizer_(\d+)\.")


def read_meta(storage: Storage, *, trusted: bool) -> dict[str, Any] | None:
    """meta.pt of a Lightning checkpoint directory (weights_only unless `trusted`), or None."""
    try:
        raw = storage.read(META)
    except FileNotFoundError:
        return None
    where = f"{storage.uri.rstrip('/')}/{META}"
    try:
        meta = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{where} needs arbitrary unpickling, which weights_only loading refuses; pass trusted=True only if "
            "you trust this checkpoint's author",
            path=where,
        ) from exc
    except Exception as exc:  # noqa: BLE001 - truncated or garbage bytes
        raise CheckpointCorruptError(f"{where}: unreadable ({type(exc).__name__}: {exc})", path=where) from exc
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{where} holds a {type(meta).__name__}, not Lightning's dict", path=where)
    return meta


class LightningPreset(Preset):
    name = "lightning"
    client = "PyTorch Lightning 2.6 (ModelParallelStrategy, distributed checkpoints)"
    folder_re = re.compile(r"^(?:.*[-_])?step=(?P<step>\d+)(?:-v\d+)?\.ckpt$")

    def rename(self, entries: Entries) -> Rename:
        model = entries.model + "."

        def rename(key: str) -> str:
            if key.startswith("state_dict."):
                return model + key[len("state_dict.") :]
            match = _OPTIMIZER_RE.match(key)
            if match:
                return entries.optimizer(int(match.group(1))) + "." + key[match.end() :]
            return key

        return rename

    def model_name(self, key: str) -> str | None:
        return key[len("state_dict.") :] if key.startswith("state_dict.") else None

    def progress(self, storage: Storage, *, trusted: bool) -> tuple[int | None, dict[str, Any]]:
        """meta.pt (or, for a single-file checkpoint, its own epoch and global_step)."""
        meta = None if root_is_file(storage) else read_meta(storage, trusted=trusted)
        if meta is None:
            meta = read_objects(storage, lambda k: k in ("epoch", "global_step"), trusted=trusted)
        step = meta.get("global_step")
        return (step if isinstance(step, int) else None), meta


__all__ = ["LightningPreset", "META", "read_meta"]
