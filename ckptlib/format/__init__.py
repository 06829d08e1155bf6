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

from ckptlib.format.native.file_names import shard_rank
from ckptlib.format.native.layout import (
    CheckpointInfo,
    classify,
    commit,
    open_checkpoint,
    prepare_save_target,
    read_metadata,
)
from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME, FileRecord, Manifest
from ckptlib.format.native.structure import Problem
from ckptlib.format.read.dcp_reader import CkptReader
from ckptlib.format.read.load_planner import SafeLoadPlanner
from ckptlib.format.source import detect_format, inspect_checkpoint, open_reader
from ckptlib.format.verify import summarize, verify
from ckptlib.format.write.dcp_writer import CkptWriter
from ckptlib.format.write.save_planner import CkptSavePlanner

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
