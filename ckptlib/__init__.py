"""ckptlib: elastic sharded checkpointing for PyTorch on torch.distributed.checkpoint.

This module is the public API (`save`, `async_save`, `load`, `CheckpointManager` and its
option objects, `convert`, `export`, the errors); beside it, `errors` (every error and
warning ckptlib raises), `dcp` (ckptlib as the storage of your own `dcp.save`/`dcp.load`),
`_version` and `_scrub` (credentials scrubbed from every message). The packages follow the
data flow: `cli/` -> `manager/` -> `saving/` / `loading/` -> `state/` -> `format/` ->
`storage/`, with `_torch/` (the only private torch names) and `_runtime/` beneath;
`offline/`, `presets/`, `integrations/`, `testing/` and `bench/` sit beside
(docs/architecture.md walks one save and one load).

The names that need torch are imported on first use (PEP 562), so `import ckptlib` and the
`ckpt` command's `--help` and argument errors do not import torch; the errors are here at once."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    DamagedCopyError,
    DtypeMismatchError,
    LocalLimitError,
    LockedError,
    MissingKeysError,
    NoCopyError,
    NotACheckpointError,
    NotARegularFileError,
    NotCalledByEveryRankError,
    OverwriteRefusedError,
    ProcessGroupError,
    RankInterruptedError,
    RankLostError,
    RanksDisagreeError,
    RemoteLagError,
    RemoteUnavailableError,
    ReplicationError,
    ReplicationRankLostError,
    ShapeMismatchError,
    StagingCapError,
    StateError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedError,
    UnusedKeysError,
    UploadError,
    UploadRankLostError,
    WriterProcessError,
)

#: Each public name that needs torch, and the module that defines it (imported on first use).
_ON_USE = {
    "dcp": "ckptlib.dcp",
    "exit_barrier": "ckptlib._runtime.teardown",
    "on_metrics": "ckptlib._runtime.observe",
    "MetricsCallbackWarning": "ckptlib._runtime.observe",
    "StalePointerWarning": "ckptlib.format.native.root",
    "LoadResult": "ckptlib.loading.loading",
    "load": "ckptlib.loading.loading",
    "UnmatchedPatternWarning": "ckptlib.loading.load_keys",
    "RemoteTier": "ckptlib.manager.cluster.remote_tier",
    "RemoteUnavailableWarning": "ckptlib.manager.cluster.resume",
    "SkippedDamagedStepWarning": "ckptlib.manager.cluster.resume",
    "UploadSkippedWarning": "ckptlib.manager.cluster.resume",
    "LocalUsage": "ckptlib.manager.local_budget",
    "memory_root": "ckptlib.manager.local_budget",
    "RemoteLag": "ckptlib.manager.cluster.remote_lag",
    "RemoteLagReport": "ckptlib.manager.cluster.remote_lag",
    "FreshStartWarning": "ckptlib.manager.fresh_start",
    "StaleLockWarning": "ckptlib.manager.lock",
    "SharedAgentStoreWarning": "ckptlib.manager.preemption",
    "CheckpointManager": "ckptlib.manager.manager",
    "Cluster": "ckptlib.manager.options",
    "InitialLoad": "ckptlib.manager.options",
    "Preemption": "ckptlib.manager.options",
    "EveryNSeconds": "ckptlib.manager.policies",
    "EveryNSteps": "ckptlib.manager.policies",
    "FinalStep": "ckptlib.manager.policies",
    "KeepBest": "ckptlib.manager.policies",
    "KeepEvery": "ckptlib.manager.policies",
    "KeepLast": "ckptlib.manager.policies",
    "ConvertResult": "ckptlib.offline.convert",
    "convert": "ckptlib.offline.convert",
    "ExportResult": "ckptlib.offline.export",
    "export": "ckptlib.offline.export",
    "AsyncMode": "ckptlib.saving.async_mode",
    "AsyncSave": "ckptlib.saving.background_save",
    "SaveResult": "ckptlib.saving.saving",
    "async_save": "ckptlib.saving.saving",
    "save": "ckptlib.saving.saving",
    "ElasticDistributedSampler": "ckptlib.state.sampler",
    "MergeSamplerProgress": "ckptlib.state.sampler",
    "KeepExistingRanks": "ckptlib.state.state",
    "MergingResizePolicy": "ckptlib.state.state",
    "RankLocal": "ckptlib.state.state",
    "ResizePolicy": "ckptlib.state.state",
    "ResizeWarning": "ckptlib.state.state",
    "RNGState": "ckptlib.state.state",
}

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from ckptlib import dcp
    from ckptlib._runtime.observe import MetricsCallbackWarning, on_metrics
    from ckptlib._runtime.teardown import exit_barrier
    from ckptlib.format.native.root import StalePointerWarning
    from ckptlib.loading.load_keys import UnmatchedPatternWarning
    from ckptlib.loading.loading import LoadResult, load
    from ckptlib.manager.cluster.remote_lag import RemoteLag, RemoteLagReport
    from ckptlib.manager.cluster.remote_tier import RemoteTier
    from ckptlib.manager.cluster.resume import (
        RemoteUnavailableWarning,
        SkippedDamagedStepWarning,
        UploadSkippedWarning,
    )
    from ckptlib.manager.fresh_start import FreshStartWarning
    from ckptlib.manager.local_budget import LocalUsage, memory_root
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
    from ckptlib.state.state import (
        KeepExistingRanks,
        MergingResizePolicy,
        RankLocal,
        ResizePolicy,
        ResizeWarning,
        RNGState,
    )


def __getattr__(name: str) -> Any:
    """A public name on first use: imported from its module, then kept here."""
    module = _ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptlib' has no attribute {name!r}")
    found = importlib.import_module(module)
    value = found if name == "dcp" else getattr(found, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_USE))


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
    "DamagedCopyError",
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
    "LocalLimitError",
    "LocalUsage",
    "LockedError",
    "MergeSamplerProgress",
    "MergingResizePolicy",
    "MetricsCallbackWarning",
    "MissingKeysError",
    "NoCopyError",
    "NotACheckpointError",
    "NotARegularFileError",
    "NotCalledByEveryRankError",
    "OverwriteRefusedError",
    "ProcessGroupError",
    "RankInterruptedError",
    "RankLostError",
    "RanksDisagreeError",
    "RemoteTier",
    "RemoteLag",
    "RemoteLagError",
    "RemoteLagReport",
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
    "UploadSkippedWarning",
    "SharedAgentStoreWarning",
    "StaleLockWarning",
    "StalePointerWarning",
    "StagingCapError",
    "StateError",
    "StorageError",
    "UnmatchedPatternWarning",
    "UnsafeCheckpointError",
    "UploadError",
    "UploadRankLostError",
    "WriterProcessError",
    "UnsupportedError",
    "UnusedKeysError",
    "__version__",
    "exit_barrier",
    "load",
    "memory_root",
    "on_metrics",
    "save",
]
