"""Read once, exchange over the process group: the transport of a load's shared reads
(`ckptlib.format.read.shared_reads`, planned by `ckptlib.format.read.read_schedule`), and a load's
retries around copies that failed.

Transport: point-to-point messages on one dedicated gloo group per caller group, created
collectively by the first load of that group and cached for its world (never the async-save
group, which a background save may be using at the same time; a new world, `_runtime.world`,
makes new ones). Between two ranks a round sends one message
of flags (1: the item follows intact; 0: its reader could not read it) and then each item's
raw bytes (a placeholder of the same length for a flagged one), every message with its own
tag, so nothing depends on the order gloo delivers them in. Memory: a rank holds at most one
round of items (`read_schedule.ROUND_BYTES`, or one item larger than that).

Retries (loads given copies, `ckptlib.format.read.copies`): when a rank found every copy of a file
it read bad, the failure reaches every rank through DCP's gathering of read failures; every
rank then excludes those copies and the load runs again, so that a rank holding another copy
reads the file (or, with none left anywhere, the coordinator raises the error naming every
copy tried). Each retry excludes at least one more copy, so retries end.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ckptlib._runtime import agree as _dist
from ckptlib._runtime import world as _world
from ckptlib._torch import dcp_shims
from ckptlib.errors import CopiesExhaustedError, CopyFallbackWarning, warn_scrubbed
from ckptlib.format.write.transaction import unwrap_dcp_error

_groups: dict[Any, Any] = {}  # caller's group (WORLD for the default one) -> its exchange group


def _forget_world() -> None:
    """The groups of a world this process left are dead: the next load makes the new world's."""
    _groups.clear()


_world.on_new_world(_forget_world)


def exchange_group(group=None):
    """The dedicated gloo group of `group`'s shared reads; collective on first use (every rank
    of `group` calls it in `ckptlib.load`, before DCP's load). None without a process group."""
    if not _dist.is_distributed():
        return None
    _world.generation()  # a new world: the old one's groups are forgotten first
    key = dist.group.WORLD if group is None else group
    found = _groups.get(key)
    if found is None:
        if group is None:
            found = dist.new_group(backend="gloo")
        elif str(dist.get_backend(group)).lower() == "gloo":
            # A gloo subgroup carries the point-to-point messages itself: a new group with
            # local synchronization hangs whenever its members belong to different numbers of
            # groups (torch names it by a hash of its ranks and of that number; rank 0 of
            # `ckpt validate` loading at 1, 2 and 3 of 3 ranks is in more groups than rank 1).
            found = group
        else:
            ranks = dist.get_process_group_ranks(group)
            found = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        _groups[key] = found
    return found


def _as_tensor(data: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # bytes from an object store are read-only; sending only reads them
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


class GlooTransport:
    """`shared_reads.Transport` over point-to-point messages on `exchange_group(group)`; ranks
    are `group`'s (DCP's), sent to by their global ranks (which every torch takes)."""

    def __init__(self, xgroup, group=None):
        self.group = xgroup
        size = dist.get_world_size(group)
        self._peer = [r if group is None else dist.get_global_rank(group, r) for r in range(size)]  # global ranks
        self._sent: dict[int, int] = defaultdict(int)  # peer -> messages sent to it (their tags)
        self._received: dict[int, int] = defaultdict(int)

    def _tag(self, counts: dict[int, int], peer: int) -> int:
        counts[peer] += 1
        return counts[peer]

    def run_round(
        self, sends: Sequence[tuple[int, memoryview | None, int]], recvs: Sequence[tuple[int, int]]
    ) -> list[memoryview | None]:
        works, keep = [], []
        outgoing: dict[int, list[tuple[memoryview | None, int]]] = defaultdict(list)
        for dst, data, length in sends:
            outgoing[dst].append((data, length))
        for dst, items in outgoing.items():
            flags = torch.tensor([0 if data is None else 1 for data, _ in items], dtype=torch.uint8)
            keep.append(flags)
            works.append(dist.isend(flags, group=self.group, dst=self._peer[dst], tag=self._tag(self._sent, dst)))
            for data, length in items:
                tag = self._tag(self._sent, dst)
                if length:
                    tensor = torch.empty(length, dtype=torch.uint8) if data is None else _as_tensor(data)
                    keep.append(tensor)
                    works.append(dist.isend(tensor, group=self.group, dst=self._peer[dst], tag=tag))
        incoming: dict[int, list[int]] = defaultdict(list)
        for index, (src, _) in enumerate(recvs):
            incoming[src].append(index)
        buffers: list[bytearray] = [bytearray(length) for _, length in recvs]
        flags_from: dict[int, torch.Tensor] = {}
        for src, indices in incoming.items():
            flags_from[src] = torch.empty(len(indices), dtype=torch.uint8)
            peer = self._peer[src]
            works.append(dist.irecv(flags_from[src], group=self.group, src=peer, tag=self._tag(self._received, src)))
            for index in indices:
                tag = self._tag(self._received, src)
                if buffers[index]:
                    target = torch.frombuffer(buffers[index], dtype=torch.uint8)
                    works.append(dist.irecv(target, group=self.group, src=peer, tag=tag))
        for work in works:
            work.wait()
        del keep
        out: list[memoryview | None] = [None] * len(recvs)
        for src, indices in incoming.items():
            for flag, index in zip(flags_from[src].tolist(), indices):
                out[index] = memoryview(buffers[index]) if flag else None
        return out


def prepare(reader: Any, group=None, *, read_once: bool = True) -> None:
    """Give a CkptReader its transport (collective on a group's first load) and read-once setting."""
    reader.read_once = read_once
    xgroup = exchange_group(group)
    reader.exchange = None if xgroup is None else GlooTransport(xgroup, group)


def load_failure(exc: BaseException):
    """The ckptlib error of a failed DCP load: a rank's own failure before the failures of the
    ranks it could not serve (they only say that a reader failed)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        secondary = [r for r, f in failures.items() if getattr(f[0] if isinstance(f, tuple) else f, "secondary", 0)]
        if len(secondary) < len(failures):
            for rank in secondary:
                del failures[rank]  # (the property's dict itself)
    return unwrap_dcp_error(exc)


def exclude_failed(reader: Any, exc: BaseException, world: int) -> bool:
    """After a failed load given copies: when every failure is copies found bad (or a rank they
    left unserved) and some are new, exclude them on this rank's reader (every rank sees the
    same failures, so every rank excludes the same) and say the load may run again."""
    if reader.plain or world == 1:  # one copy for all, or no other rank: nothing else to try
        return False
    failures = dcp_shims.dcp_failures(exc)
    exhausted = [
        (rank, f) for rank, f in failures if isinstance(f, CopiesExhaustedError) and getattr(f, "failed_copies", None)
    ]
    if not exhausted or len(exhausted) + sum(bool(getattr(f, "secondary", 0)) for _, f in failures) < len(failures):
        return False
    new = {tuple(pair) for _, f in exhausted for pair in f.failed_copies} - set(reader.excluded)
    if not new:
        return False
    reader.excluded = frozenset(reader.excluded) | new
    for _, f in exhausted:
        seen = reader.tried.setdefault(f.file, [])
        seen.extend(entry for entry in f.tried if entry not in seen)
        for pair, entry in zip(f.failed_copies, f.tried):  # both in the order the copies were tried
            reader.unusable.setdefault(tuple(pair), tuple(entry))
    shown = "; ".join(f"rank {rank}: {f.message}" for rank, f in exhausted)
    warn_scrubbed(
        f"{reader.storage.uri}: {shown}; loading again, reading those files from other ranks' copies",
        CopyFallbackWarning,
    )
    return True


__all__ = ["GlooTransport", "exchange_group", "exclude_failed", "load_failure", "prepare"]
