"""ckptlib: elastic sharded checkpointing for PyTorch on torch.distributed.checkpoint."""

from . import dcp  # ckptlib.dcp.writer / reader: ckptlib as the storage of your own dcp.save / dcp.load
from ._version import __version__
from .background_save import AsyncSave
from .checkpoint import LoadResult, SaveResult, async_save, load, save
from .convert import ConvertResult, convert
from .data import ElasticDistributedSampler, MergeSamplerProgress
from .errors import (
    CastWarning,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CopiesExhaustedError,
    CopiesMissingError,
    CopyFallbackWarning,
    DtypeMismatchError,
    LockedError,
    MissingKeysError,
    NoCopyError,
    NotACheckpointError,
    NotARegularFileError,
    OverwriteRefusedError,
    RankLostError,
    RanksDisagreeError,
    ReplicationError,
    ReplicationRankLostError,
    ShapeMismatchError,
    StateError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedError,
    UploadError,
    UploadRankLostError,
    WriterProcessError,
)
from .export import ExportResult, export
from .manager import CheckpointManager, StaleLockWarning, StalePointerWarning
from .remote_tier import RemoteTier
from .resume import RemoteUnavailableWarning, SkippedDamagedStepWarning
from .retention import KeepBest, KeepEvery, KeepLast
from .save_policy import EveryNSeconds, EveryNSteps, FinalStep
from .state import KeepExistingRanks, MergingResizePolicy, RankLocal, ResizePolicy, ResizeWarning, RNGState
from .teardown import exit_barrier
from .tiered import TieredCheckpointManager

__all__ = [
    "AsyncSave",
    "async_save",
    "CastWarning",
    "DtypeMismatchError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointRemovedError",
    "CopiesExhaustedError",
    "CopiesMissingError",
    "CopyFallbackWarning",
    "ConvertResult",
    "convert",
    "dcp",
    "ElasticDistributedSampler",
    "EveryNSeconds",
    "EveryNSteps",
    "ExportResult",
    "export",
    "FinalStep",
    "KeepBest",
    "KeepEvery",
    "KeepExistingRanks",
    "KeepLast",
    "LoadResult",
    "LockedError",
    "MergeSamplerProgress",
    "MergingResizePolicy",
    "MissingKeysError",
    "NoCopyError",
    "NotACheckpointError",
    "NotARegularFileError",
    "OverwriteRefusedError",
    "RankLostError",
    "RanksDisagreeError",
    "RemoteTier",
    "RemoteUnavailableWarning",
    "ReplicationError",
    "ReplicationRankLostError",
    "RNGState",
    "RankLocal",
    "ResizePolicy",
    "ResizeWarning",
    "SaveResult",
    "ShapeMismatchError",
    "SkippedDamagedStepWarning",
    "StaleLockWarning",
    "StalePointerWarning",
    "StateError",
    "StorageError",
    "TieredCheckpointManager",
    "UnsafeCheckpointError",
    "UploadError",
    "UploadRankLostError",
    "WriterProcessError",
    "UnsupportedError",
    "__version__",
    "exit_barrier",
    "load",
    "save",
]


def __getattr__(name: str):
    """`ckptlib.compat` (deprecated, see its docstring) loads on first use: nothing in the package imports it."""
    if name == "compat":
        import importlib

        return importlib.import_module(f"{__name__}.compat")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
