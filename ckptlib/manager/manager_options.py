"""A CheckpointManager's options, checked before it touches anything."""

from __future__ import annotations

from typing import Any

from ckptlib.errors import StateError
from ckptlib.manager.cluster.remote_tier import tier_arguments
from ckptlib.manager.policies import KeepLast, RetentionPolicy, SavePolicy


def check_options(options: tuple, tier: tuple) -> tuple[RetentionPolicy, Any]:
    """(this root's retention policy, the remote) from the manager's arguments `options`
    (keep_last, retention, save_policy, async_save, background_staging, async_mode) and `tier`
    (remote, remote_root, keep_local, upload_concurrency), or StateError; the deprecated
    `remote_root=`/`keep_local=` spelling mapped with a DeprecationWarning."""
    keep_last, retention, save_policy, async_save, background_staging, async_mode = options
    remote, remote_root, keep_local, upload_concurrency = tier
    remote, keep_last, retention = tier_arguments(
        remote, remote_root, keep_local, keep_last, retention, upload_concurrency
    )
    if background_staging and not async_save:
        raise StateError("background_staging=True needs async_save=True")
    if async_mode not in ("thread", "process"):
        raise StateError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")
    if async_mode == "process" and not async_save:
        raise StateError("async_mode='process' needs async_save=True")
    if keep_last is not None and retention is not None:
        raise StateError("pass keep_last or retention, not both (combine policies with |)")
    if save_policy is not None and not isinstance(save_policy, SavePolicy):
        raise StateError(f"save_policy must have should_save(context), got {save_policy!r}")
    if retention is not None and not callable(getattr(retention, "keep", None)):
        raise StateError(f"retention must have keep(records), got {retention!r}")
    return (retention if retention is not None else KeepLast(keep_last)), remote


__all__ = ["check_options"]
