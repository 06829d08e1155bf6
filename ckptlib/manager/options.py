"""A CheckpointManager's option objects, and the checks of them that run before it touches anything.

The manager takes a few arguments plus these objects (in the style of DCP's `planner=` /
`storage_writer=`): `AsyncMode` (`ckptlib.saving.async_mode`) for `async_save=`, `Cluster` for
where steps live beyond one root, `Preemption` for `preemption=`, `InitialLoad` for
`initial_load=`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from ckptlib.errors import StateError
from ckptlib.manager.cluster.cluster_tier import ClusterTier
from ckptlib.manager.cluster.remote_lag import RemoteLag
from ckptlib.manager.cluster.remote_tier import RemoteTier
from ckptlib.manager.policies import KeepLast, RetentionPolicy, SavePolicy
from ckptlib.manager.preemption import DEFAULT_SIGNALS
from ckptlib.manager.single_root import SingleRoot, Tier, TierSettings
from ckptlib.storage.base import Storage


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The cluster tier: the manager's root is this node's local root, each node's files go to
    `replicas` partner nodes, and every step is uploaded to `remote` (a URI, keeping every
    step, or a `RemoteTier` with its own retention). `node`: this node's identity (default:
    torchrun's GROUP_RANK, else the hostname; see `ckptlib.manager.cluster.topology`).
    `remote_lag`: how far the remote may fall behind while unreachable before a save fails
    (default: no limit, uploads retried; `ckptlib.manager.cluster.remote_lag`).
    `max_local_bytes`: the most a node's root may hold (its steps and the replicas it keeps);
    a save past it, or past the root's free space, is refused on every rank before anything is
    written (`LocalLimitError`); a root on tmpfs is always held to its free space
    (`ckptlib.manager.local_budget`: the in-memory tier)."""

    replicas: int = 0
    remote: str | os.PathLike | RemoteTier | None = None
    node: Any = None
    remote_lag: RemoteLag = RemoteLag()
    max_local_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 0:
            raise StateError(f"replicas must be a non-negative int, got {self.replicas!r}")
        remote = self.remote
        if remote is not None and not isinstance(remote, (RemoteTier, str, os.PathLike)):
            raise StateError(f"remote must be a URI or a RemoteTier, got {type(remote).__name__} {remote!r}")
        if isinstance(remote, (str, os.PathLike)):
            object.__setattr__(self, "remote", RemoteTier(remote))
        limit = self.max_local_bytes
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
            raise StateError(f"max_local_bytes must be a positive int (bytes) or None, got {limit!r}")
        if not isinstance(self.remote_lag, RemoteLag):
            lag = self.remote_lag
            raise StateError(f"remote_lag must be a RemoteLag, got {type(lag).__name__} {lag!r}")


@dataclasses.dataclass(frozen=True)
class Preemption:
    """Save on preemption: a handler for `signals` records the signal, and the next
    `maybe_save` saves the step reached on every rank (`CheckpointManager.maybe_save`)."""

    signals: tuple[int, ...] = DEFAULT_SIGNALS

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", tuple(self.signals))

    @classmethod
    def of(cls, value: Any) -> "Preemption | None":
        """`preemption=` as given: False or None (no handler), True (SIGTERM and SIGUSR1), a Preemption."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise StateError(f"preemption must be a bool or a Preemption, got {type(value).__name__} {value!r}")


@dataclasses.dataclass(frozen=True)
class InitialLoad:
    """A checkpoint (any format ckptlib reads) that `load()` reads when the root has no
    committed step yet: only the state's modules unless `only` names the state entries to take."""

    path: str | os.PathLike
    only: Sequence[str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        if self.only is not None:
            object.__setattr__(self, "only", tuple(self.only))

    @classmethod
    def of(cls, value: Any) -> "InitialLoad | None":
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(value)
        raise StateError(f"initial_load must be a path or an InitialLoad, got {type(value).__name__} {value!r}")


def check_retention(
    keep_last: int | None, retention: RetentionPolicy | None, save_policy: SavePolicy | None
) -> RetentionPolicy:
    """This root's retention policy from the manager's arguments, or StateError."""
    if keep_last is not None and retention is not None:
        raise StateError("pass keep_last or retention, not both (combine policies with |)")
    if save_policy is not None and not isinstance(save_policy, SavePolicy):
        raise StateError(f"save_policy must have should_save(context), got {save_policy!r}")
    if retention is not None and not callable(getattr(retention, "keep", None)):
        raise StateError(f"retention must have keep(records), got {retention!r}")
    return retention if retention is not None else KeepLast(keep_last)


def make_tier(storage: Storage, uri: str, settings: TierSettings, cluster: Cluster | None) -> Tier:
    """The tier a manager holds: the cluster tier `cluster` describes, else its single root."""
    if cluster is None:
        return SingleRoot(storage, uri, settings)
    return ClusterTier(storage, settings, cluster)


__all__ = ["Cluster", "InitialLoad", "Preemption", "check_retention", "make_tier"]
