"""What checkpoint bytes mean: DCP's layout plus the ckptlib manifest, and foreign formats.

- native: `dcp_writer`/`dcp_reader` (DCP's file layout over a Storage, item and block
  checksums from `block_checks`, ranged reads from `ranged_io`; tensor items written by
  `item_encoder` and decoded by `item_decoder`, both through `zip_directory`; `planned_reader`
  is the base of every reader), `manifest`, `layout` (what a directory is; commit),
  `transaction` (one save: prepare, write, commit, clean up), `structure` (consistency of
  `.metadata`), `verify`, `save_planner`/`load_planner` (DCP's planners, made linear at scale
  and safe to unpickle);
- foreign: `torch_save` (streaming its archives through `torch_archive`), `v0`, `safetensors`
  (each format's reader and writer), sharing `foreign`; `source` is the one entry point that
  detects a source and opens a reader for native and foreign checkpoints alike; `streaming`
  converts between them tensor by tensor, and `output` is the one writer path of convert and export.
"""

from .dcp_reader import CkptReader
from .dcp_writer import CkptWriter
from .layout import CheckpointInfo, classify, commit, open_checkpoint, prepare_save_target, read_metadata, shard_rank
from .load_planner import SafeLoadPlanner
from .manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME, FileRecord, Manifest
from .save_planner import CkptSavePlanner
from .source import detect_format, inspect_checkpoint, open_reader
from .structure import Problem
from .verify import summarize, verify

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
