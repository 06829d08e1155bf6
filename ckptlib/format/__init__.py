"""What checkpoint bytes mean: DCP's layout plus the ckptlib manifest."""

from .dcp_io import CkptReader, CkptWriter, SafeLoadPlanner, read_metadata
from .layout import CheckpointInfo, classify, commit, open_checkpoint, prepare_save_target, shard_rank
from .verify import Problem, summarize, verify
from .manifest import MANIFEST_NAME, METADATA_NAME, PENDING_NAME, FileRecord, Manifest

__all__ = [
    "CheckpointInfo", "CkptReader", "CkptWriter", "FileRecord", "MANIFEST_NAME", "METADATA_NAME",
    "Manifest", "PENDING_NAME", "SafeLoadPlanner", "classify", "commit", "open_checkpoint",
    "prepare_save_target", "read_metadata", "shard_rank", "Problem", "summarize", "verify",
]
