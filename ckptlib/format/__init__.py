"""What checkpoint bytes mean: DCP's layout plus the ckptlib manifest, and foreign formats.

Sub-packages by concern, from the bytes up:
- `items/`: one stored tensor item (encoding, decoding, checksums, ranged reads);
- `native/`: ckptlib's own checkpoints (manifest, directory and root layout, deletion, safe unpickling);
- `read/`: DCP's StorageReader over a Storage and the schedule of a load's reads;
- `write/`: one save into a directory, committed or nothing;
- `foreign/`: torch.save, torch 1.13/2.0 archives, v0 and safetensors, each reader and writer in one file.

Its faces: `source` detects what a source is and opens a reader for native and foreign
checkpoints alike; `output` is the one writer path of convert and export, fed tensor by tensor
by `streaming`; `verify` checks one checkpoint offline (with `safetensors_check` for
safetensors files).
"""

import importlib
import sys
import types
from typing import Any

#: Each public name and the module it lives in, imported on first use: a package import stays
#: free of torch, so `ckpt ls` reads a root's manifests without it (see ckptlib/cli/inspect_cmds.py).
_ON_USE = {
    "shard_rank": "ckptlib.format.native.file_names",
    "CheckpointInfo": "ckptlib.format.native.layout",
    "classify": "ckptlib.format.native.layout",
    "commit": "ckptlib.format.native.layout",
    "open_checkpoint": "ckptlib.format.native.layout",
    "prepare_save_target": "ckptlib.format.native.layout",
    "read_metadata": "ckptlib.format.native.layout",
    "MANIFEST_NAME": "ckptlib.format.native.manifest",
    "METADATA_NAME": "ckptlib.format.native.manifest",
    "PENDING_NAME": "ckptlib.format.native.manifest",
    "FileRecord": "ckptlib.format.native.manifest",
    "Manifest": "ckptlib.format.native.manifest",
    "Problem": "ckptlib.format.native.structure",
    "CkptReader": "ckptlib.format.read.dcp_reader",
    "SafeLoadPlanner": "ckptlib.format.read.load_planner",
    "detect_format": "ckptlib.format.source",
    "inspect_checkpoint": "ckptlib.format.source",
    "open_reader": "ckptlib.format.source",
    "summarize": "ckptlib.format.verify",
    "verify": "ckptlib.format.verify",
    "CkptWriter": "ckptlib.format.write.dcp_writer",
    "CkptSavePlanner": "ckptlib.format.write.save_planner",
}


def __getattr__(name: str) -> Any:
    """A public name on first use: imported from its module, then kept here."""
    module = _ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptlib.format' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_USE))


class _Package(types.ModuleType):
    """`ckptlib.format.verify` is the function, as it was when this package imported it at once,
    also after its module (`ckptlib.format.verify`, the same name) was imported and set here."""

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name in _ON_USE and isinstance(value, types.ModuleType):
            return getattr(value, name)
        return value


sys.modules[__name__].__class__ = _Package


__all__ = [
    "CheckpointInfo",
    "CkptReader",
    "CkptSavePlanner",
    "CkptWriter",
    "FileRecord",
    "MANIFEST_NAME",
    "METADATA_NAME",
    "Manifest",
    "PENDING_NAME",
    "SafeLoadPlanner",
    "classify",
    "commit",
    "detect_format",
    "inspect_checkpoint",
    "open_checkpoint",
    "open_reader",
    "prepare_save_target",
    "read_metadata",
    "shard_rank",
    "Problem",
    "summarize",
    "verify",
]
