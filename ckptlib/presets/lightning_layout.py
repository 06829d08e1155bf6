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
`global_step`, `LoadResult.metadata` holds meta.pt). In a save folder the newest is read
(`LightningPreset.newness`): the highest step (a `last.ckpt`'s is its meta.pt's
`global_step`), then `last` over a step-named copy of the same save, then the epoch, then the
version counter (`-v1` is newer than its unversioned name). The single-file `.ckpt` other strategies
write (a torch.save of the whole dict) is read with the same keys.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from typing import Any

import torch

from ckptlib.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError
from ckptlib.format.native.root import StepInfo, scan
from ckptlib.presets.preset import Entries, Preset, Rename, read_objects
from ckptlib.storage.base import Storage, root_is_file

META = "meta.pt"
_OPTIMIZER_RE = re.compile(r"^optimizer_(\d+)\.")
LAST_RE = re.compile(r"^last(?:-v\d+)?\.ckpt$")  # ModelCheckpoint(save_last=True)'s folder, versioned
_EPOCH_RE = re.compile(r"(?:^|[-_])epoch=(\d+)(?:[-_.]|$)")
_VERSION_RE = re.compile(r"-v(\d+)\.ckpt$")


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

    def scan(self, root: Storage) -> list[StepInfo]:
        """Every `...step=S[-vN].ckpt` folder, and every `last[-vN].ckpt` at the step its
        meta.pt records (`global_step`; one whose meta.pt cannot be read without `trusted` or
        holds no step is left out: name it to load it), oldest first by `newness`."""
        found = []
        for info in scan(root, parse=lambda name: -1 if LAST_RE.match(name) else self.step_of(name), dcp_state="dcp"):
            if info.step == -1:
                try:
                    meta = read_meta(root.child(info.name), trusted=False)
                except CheckpointError:
                    continue
                step = meta.get("global_step") if meta is not None else None
                if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                    continue
                info = dataclasses.replace(info, step=step)
            found.append(info)
        return sorted(found, key=lambda s: (self.newness(s), s.name))

    def newness(self, info: StepInfo) -> tuple:
        """Lightning's order: the step, then `last` over a step-named copy of the same save
        (`save_last` writes it after the others), then the epoch, then the version counter
        (`-v1`, `-v2`: Lightning adds one when the name is taken, so a version is newer than
        its unversioned name)."""
        epoch = _EPOCH_RE.search(info.name)
        version = _VERSION_RE.search(info.name)
        return (
            info.step,
            1 if LAST_RE.match(info.name) else 0,
            int(epoch.group(1)) if epoch else 0,
            int(version.group(1)) if version else 0,
        )

    def looks_like_root(self, root: Storage) -> bool:
        return any(self.step_of(name) is not None or LAST_RE.match(name) for name in root.list_children())

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
