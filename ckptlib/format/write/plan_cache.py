"""Plan once (issue 25.2): reuse a save's plans while the state's structure is unchanged.

Planning a save costs O(chunks) on every rank and, on the coordinator, O(ranks x tensors)
for the global plan and `.metadata`: minutes at thousands of ranks, the same result on every
save of a training run. DCP caches plans keyed by the planner's class name (two planners
then share one cache, pytorch/pytorch#158767) and compares every rank's full local plan;
ckptlib owns its cache instead:

- a `PlanCache` belongs to whoever saves repeatedly (a CheckpointManager holds one; a small
  bounded module-level set, `shared(ranks, kind)`, serves plain `ckptlib.save` calls on the
  same group and storage kind). It holds one `CachedPlan`: this rank's structure
  (`fingerprint`: a digest of every key's path, kind, shape, dtype, flags, placements and
  mesh, plus the group's ranks and this rank), this rank's final plan, an agreed `token`
  and, on the coordinator, a pristine `.metadata` skeleton (the writer's `finish` and the
  receipt mutate the Metadata they are given, so each save gets a shallow copy);
- `PlanReuse` is one save's use of it: `vote` (inside the agreement round the save already
  has, on the very state it writes) compares the structure with the cached one; the round's
  all_reduce (`_dist.agree`'s ballot) tells every rank whether all are unchanged *and* hold
  the same token (a rank whose cache was updated by a save the others did not complete, or
  evicted, makes everyone re-plan); then the planner reuses the plans (no local plan, no
  global plan: the coordinator scatters empty plans and copies the skeleton) or plans from
  scratch and records what it made;
- `install` runs only after the save committed: a failed save never changes the cache.

Object values contribute their key only (a step counter or a learning rate changes its
pickle every save, never the plan: item sizes come from the write results). Anything the
fingerprint cannot describe exactly (tensor subclasses, ShardedTensors, objects that plan
their own items, Stateful values, DTensors whose local shard disagrees with them on
requires_grad) makes the save uncacheable: it plans from scratch, always.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.stateful import Stateful

from ckptlib._runtime import agree as _dist
from ckptlib._torch import dcp_shims, parallel, probes
from ckptlib.format.native.plan_codec import placements_key

# The ballot of one save in its agreement round (all_reduce MAX): [changed, token, -token].
_CHANGED, _UNKNOWN_TOKEN = 1, 0
SHARED_CACHES = 4  # plain `ckptlib.save` caches kept per process, least recently used evicted


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    """What one committed save planned, on this rank: its final plan and, on the coordinator,
    the `.metadata` skeleton (before the writer filled it in). Kept as the objects themselves
    (~480 bytes a chunk on the coordinator, ckpt bench scale): a pickle of them would cost a
    hit a third of the first save's planning to decode, and in a single process would not keep
    which strings are shared with the storage records (`.metadata` shows it)."""

    fingerprint: bytes
    token: int
    final_plan: SavePlan
    skeleton: Metadata | None

    def unpack(self) -> tuple[SavePlan, Metadata | None]:
        """This save's copy: the final plan and a Metadata no save has filled in (the writer's
        `finish` and the receipt change the one they are given)."""
        return self.final_plan, None if self.skeleton is None else copy.copy(self.skeleton)


class PlanCache:
    """The plans of the last committed save of one saver (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: CachedPlan | None = None

    @property
    def entry(self) -> CachedPlan | None:
        return self._entry

    def install(self, entry: CachedPlan) -> None:
        with self._lock:
            self._entry = entry

    def clear(self) -> None:
        with self._lock:
            self._entry = None


_shared: collections.OrderedDict[tuple, PlanCache] = collections.OrderedDict()
_shared_lock = threading.Lock()


def shared(ranks: tuple[int, ...], kind: Any) -> PlanCache:
    """The module-level cache of plain saves on the group of `ranks` to storage of `kind`."""
    key = (ranks, kind)
    with _shared_lock:
        cache = _shared.pop(key, None) or PlanCache()
        _shared[key] = cache
        while len(_shared) > SHARED_CACHES:
            _shared.popitem(last=False)
        return cache


def clear_shared() -> None:
    """Forget every module-level cache (the next plain save of each group plans from scratch)."""
    with _shared_lock:
        _shared.clear()


def group_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of `group` in group-rank order ((0,) in a single process)."""
    if not _dist.is_distributed():
        return (0,)
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


# ------------------------------------------------------------------ the structure of a state


def _mesh_key(mesh: Any) -> tuple:
    ranks = mesh.mesh
    return (
        str(mesh.device_type),
        tuple(ranks.shape),
        tuple(ranks.flatten().tolist()),
        getattr(mesh, "mesh_dim_names", None),
        None if mesh.get_coordinate() is None else tuple(mesh.get_coordinate()),
    )


def _tensor_key(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.dtype, tensor.layout, tensor.requires_grad, tensor.is_pinned())


def fingerprint(flat: dict[str, Any], mappings: dict[str, Any], ranks: tuple[int, ...], rank: int) -> bytes | None:
    """A digest of everything this rank's save plan depends on (see `structure`), or None."""
    found = structure(flat, mappings, ranks, rank)
    return None if found is None else hashlib.blake2b(repr(found).encode(), digest_size=32).digest()


def structure(flat: dict[str, Any], mappings: dict[str, Any], ranks: tuple[int, ...], rank: int) -> tuple | None:
    """Everything this rank's save plan depends on: every key with its path, kind, shape,
    dtype, flags, placements and mesh, then the group's ranks and this rank; None if some
    value's plan cannot be described so (see the module). Its repr is exact: types and
    placements by name, 0 and "0" apart."""
    dtensor = probes.dtensor_cls()
    meshes: dict[int, tuple] = {}
    entries = []
    for fqn, value in flat.items():
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            entry: tuple = ("tensor", *_tensor_key(value))
        elif dtensor is not None and kind is dtensor:
            local = parallel.local_tensor(value)
            if type(local) is not torch.Tensor:
                return None
            mesh = value.device_mesh
            mesh_key = meshes.get(id(mesh))
            if mesh_key is None:
                mesh_key = meshes[id(mesh)] = _mesh_key(mesh)
            if local.requires_grad != value.requires_grad:
                return None  # what DCP records then depends on the grad mode of the planning thread
            entry = ("dtensor", tuple(value.shape), *_tensor_key(local)[1:], placements_key(value.placements), mesh_key)
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__") or isinstance(value, Stateful):
            return None  # tensor subclasses (ShardedTensor, ...), objects that plan themselves
        else:
            entry = ("object",)
        entries.append((fqn, mappings.get(fqn), entry))
    return (ranks, rank, tuple(entries))


# ------------------------------------------------------------------ one save's use of a cache


@dataclasses.dataclass
class PlanTiming:
    """Seconds this rank spent planning (its own work, not the collectives' waits) and, on
    the coordinator, in the global plan."""

    planning_s: float = 0.0
    global_plan_s: float | None = None


class PlanReuse:
    """One save's ballot on reusing `cache`'s plans and, after the agreement round, the
    decision every rank shares (`hit`); the planner records what it planned on a miss, and
    `install` caches it once the save committed."""

    def __init__(self, cache: PlanCache | None, group=None) -> None:
        self.cache = cache
        self.group = group
        self.votes = [_CHANGED, _UNKNOWN_TOKEN, -_UNKNOWN_TOKEN]
        self.hit = False
        self.entry: CachedPlan | None = None  # the cached plans this save compared with
        self.timing = PlanTiming()
        self._fingerprint: bytes | None = None
        self._flat: tuple[dict, dict, dict] | None = None  # (voted state, flat state, mappings)
        self._token = _UNKNOWN_TOKEN
        self.is_coordinator = False  # told by the planner
        self.final_plan: SavePlan | None = None
        self.skeleton: Metadata | None = None
        self._reused: tuple[SavePlan, Metadata | None] | None = None

    # -- the agreement round (`_dist.agree(..., ballot=self)`) ---------------------------
    def vote(self, state_dict: dict[str, Any]) -> None:
        """This rank's vote on the state it is about to write. Never raises: a state DCP will
        refuse is only uncacheable here, and DCP raises its own error during the save."""
        if self.cache is None:
            return
        try:
            flat, mappings = dcp_shims.flatten_state_dict(state_dict)
            found = fingerprint(flat, mappings, group_ranks(self.group), _dist.get_rank(self.group))
        except Exception:  # noqa: BLE001 - the save's own planning raises it, as without a cache
            return
        if found is None:
            return
        self._fingerprint = found
        self._flat = (state_dict, flat, mappings)
        entry = self.entry = self.cache.entry
        if entry is not None:
            changed = _CHANGED if entry.fingerprint != found else 0
            self.votes = [changed, entry.token, -entry.token]

    def counted(self, reduced: list[int]) -> None:
        """Every rank's votes, reduced (MAX): reuse only if nobody changed and all hold one token."""
        changed, newest, oldest = reduced[0], reduced[1], -reduced[2]
        self.hit = self.entry is not None and changed == 0 and newest == oldest == self.entry.token
        self._token = self.entry.token if self.hit else newest + 1

    # -- the planner's side ---------------------------------------------------------------
    def reused(self) -> tuple[SavePlan, Metadata | None]:
        """On a hit: this save's copy of the cached final plan and skeleton (unpacked once)."""
        if self._reused is None:
            assert self.hit and self.entry is not None
            self._reused = self.entry.unpack()
        return self._reused

    def flattened(self, state_dict: dict[str, Any]) -> tuple[dict, dict] | None:
        """The flat state and mappings `vote` made, if `state_dict` holds the very values
        it voted on (DCP hands the planner a copy of the top-level mapping)."""
        if self._flat is None:
            return None
        voted, flat, mappings = self._flat
        if len(voted) != len(state_dict) or any(state_dict.get(k, voted) is not v for k, v in voted.items()):
            return None
        return flat, mappings

    def install(self) -> None:
        """After the save committed: cache what it planned (nothing on a hit or when uncacheable)."""
        if self.cache is None or self.hit or self._fingerprint is None or self.final_plan is None:
            return
        if self.is_coordinator and self.skeleton is None:
            return
        self.cache.install(CachedPlan(self._fingerprint, self._token, self.final_plan, self.skeleton))


__all__ = [
    "CachedPlan",
    "PlanCache",
    "PlanReuse",
    "PlanTiming",
    "clear_shared",
    "fingerprint",
    "group_ranks",
    "shared",
    "structure",
]
