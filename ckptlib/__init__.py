"""ckptlib: elastic sharded checkpointing for PyTorch on torch.distributed.checkpoint."""

from ._dist import exit_barrier
from .async_save import AsyncSave
from .checkpoint import LoadResult, SaveResult, __version__, load, save
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    LockedError,
    MissingKeysError,
    NotACheckpointError,
    ShapeMismatchError,
    StateError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedError,
    UploadError,
)
from .convert import ConvertResult, convert
from .export import ExportResult, export
from .manager import CheckpointManager, StaleLockWarning, StalePointerWarning
from .retention import KeepBest, KeepEvery, KeepLast
from .save_policy import EveryNSeconds, EveryNSteps, FinalStep
from .tiered import TieredCheckpointManager
from .data import ElasticDistributedSampler, MergeSamplerProgress
from .state import KeepExistingRanks, MergingResizePolicy, RankLocal, ResizePolicy, ResizeWarning, RNGState

__all__ = [
    "AsyncSave", "CheckpointCorruptError", "CheckpointError", "CheckpointExistsError", "CheckpointIncompleteError",
    "CheckpointManager", "CheckpointNotFoundError", "ConvertResult", "convert", "ElasticDistributedSampler",
    "EveryNSeconds", "EveryNSteps",
    "ExportResult", "export", "FinalStep", "KeepBest", "KeepEvery", "KeepExistingRanks", "KeepLast", "LoadResult",
    "LockedError", "MergeSamplerProgress", "MergingResizePolicy", "MissingKeysError", "NotACheckpointError", "RNGState", "RankLocal", "ResizePolicy",
    "ResizeWarning", "SaveResult", "ShapeMismatchError", "StaleLockWarning", "StalePointerWarning", "StateError",
    "StorageError", "TieredCheckpointManager", "UnsafeCheckpointError", "UploadError", "UnsupportedError", "__version__", "exit_barrier", "load", "save",
]
