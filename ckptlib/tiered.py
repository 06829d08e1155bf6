"""Deprecated: the single-machine tier's names. The cluster tier (`ckptlib.manager.cluster.cluster_tier`) is
what `CheckpointManager(root, remote=..., replicas=...)` holds now.

`TieredCheckpointManager(local_root, remote_root=URI, keep_local=N, ...)` and
`CheckpointManager(local_root, remote_root=URI, keep_local=N, ...)` keep working for one
release, with a DeprecationWarning: they make `CheckpointManager(local_root, keep_last=N,
remote=RemoteTier(URI, keep_last=..., retention=...))`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ckptlib.errors import UploadError
from ckptlib.manager.manager import CheckpointManager


class TieredCheckpointManager(CheckpointManager):
    """Deprecated: `CheckpointManager(root, keep_last=N, remote=RemoteTier(URI, ...))`."""

    def __init__(self, root: str | os.PathLike, *, remote_root: str | os.PathLike, **kwargs: Any):
        warnings.warn(
            "TieredCheckpointManager is deprecated; use CheckpointManager(root, keep_last=N, "
            "remote=RemoteTier(URI, keep_last=...))",
            DeprecationWarning,
            stacklevel=2,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # one warning, the one above
            super().__init__(root, remote_root=remote_root, **kwargs)


__all__ = ["TieredCheckpointManager", "UploadError"]
