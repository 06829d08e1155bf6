"""Presets: read (and write) the checkpoints of the tools users already have, as they lay them out.

    ckptlib.load("runs/tiny/", state, preset="composer")        # Composer's save folder: its latest-rank0.pt
    ckptlib.load("outputs/checkpoint", state, preset="torchtitan")  # the highest step-N
    ckptlib.load("ckpts/epoch=0-step=4.ckpt", state, preset="lightning")
    ckpt ls runs/tiny --preset composer; ckpt export ckpts/last.ckpt hf/ --preset lightning --model-only

`state` uses ckptlib's own names (`{"model": module, "optim": optimizer}`, or whatever its
module and optimizer entries are called): the preset renames the client's keys onto them,
finds the newest checkpoint of a save folder, allows the plain-data objects the client
saves (and nothing more) without `trusted=True`, and reports the client's progress in
`LoadResult.step` / `LoadResult.metadata`.

- `preset`: what every preset is (`Preset`); `PRESETS` here holds those `preset=` names;
- `composer_layout`, `lightning_layout`, `titan_layout`: how Composer, Lightning and
  torchtitan lay out their checkpoints;
- `composer_save`: `save`, a ckptlib checkpoint Composer autoresumes from.
"""

from __future__ import annotations

from ckptlib.errors import StateError
from ckptlib.presets.composer_layout import ComposerPreset
from ckptlib.presets.lightning_layout import LightningPreset
from ckptlib.presets.preset import Entries, Preset
from ckptlib.presets.titan_layout import FlatOptimizer, TorchtitanPreset
from ckptlib.storage.base import Storage

composer = ComposerPreset()
torchtitan = TorchtitanPreset()
lightning = LightningPreset()
PRESETS: dict[str, Preset] = {p.name: p for p in (composer, torchtitan, lightning)}


def get(preset: str | Preset) -> Preset:
    """The preset named `preset` (or `preset` itself when it is one)."""
    if isinstance(preset, Preset):
        return preset
    found = PRESETS.get(preset) if isinstance(preset, str) else None
    if found is None:
        raise StateError(f"unknown preset {preset!r}; the presets are {', '.join(sorted(PRESETS))}")
    return found


def detect_root(root: Storage) -> Preset | None:
    """The preset whose save folder `root` looks like, or None."""
    for preset in PRESETS.values():
        if preset.looks_like_root(root):
            return preset
    return None


__all__ = ["Entries", "FlatOptimizer", "PRESETS", "Preset", "composer", "detect_root", "get", "lightning", "torchtitan"]
