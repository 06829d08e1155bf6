"""ckptlib: elastic sharded checkpointing for PyTorch on torch.distributed.checkpoint.

This module is the public API (`save`, `async_save`, `load`, `CheckpointManager` and its
option objects, `convert`, `export`, the errors); beside it, `errors` (every error and
warning ckptlib raises), `dcp` (ckptlib as the storage of your own `dcp.save`/`dcp.load`),
`_version` and `_scrub` (credentials scrubbed from every message). The packages follow the
data flow: `cli/` -> `manager/` -> `saving/` / `loading/` -> `state/` -> `format/` ->
`storage/`, with `_torch/` (the only private torch names) and `_runtime/` beneath;
`offline/`, `presets/`, `integrations/`, `testing/` and `bench/` sit beside
(docs/architecture.md walks one save and one load)."""

from __future__ import annotations

from ckptlib import dcp  # ckptlib.dcp.writer / reader: ckptlib as the storage of your own dcp.save / dcp.load
from ckptlib._runtime.teardown import exit_barrier
from ckptlib._version import __version__
from ckptlib.errors import (
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
    RemoteUnavailableError,
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
from ckptlib.format.native.root import StalePointerWarning
from ckptlib.loading.loading import LoadResult, load
from ckptlib.manager.cluster.remote_tier import RemoteTier
from ckptlib.manager.cluster.resume import RemoteUnavailableWarning, SkippedDamagedStepWarning
from ckptlib.manager.fresh_start import FreshStartWarning
from ckptlib.manager.lock import StaleLockWarning
from ckptlib.manager.manager import CheckpointManager
from ckptlib.manager.options import Cluster, InitialLoad, Preemption
from ckptlib.manager.policies import EveryNSeconds, EveryNSteps, FinalStep, KeepBest, KeepEvery, KeepLast
from ckptlib.offline.convert import ConvertResult, convert
from ckptlib.offline.export import ExportResult, export
from ckptlib.saving.async_mode import AsyncMode
from ckptlib.saving.background_save import AsyncSave
from ckptlib.saving.saving import SaveResult, async_save, save
from ckptlib.state.sampler import ElasticDistributedSampler, MergeSamplerProgress
from ckptlib.state.state import KeepExistingRanks, MergingResizePolicy, RankLocal, ResizePolicy, ResizeWarning, RNGState

__all__ = [
    "AsyncMode",
    "AsyncSave",
    "Cluster",
    "InitialLoad",
    "Preemption",
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
    "RemoteUnavailableError",
    "RemoteUnavailableWarning",
    "FreshStartWarning",
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
