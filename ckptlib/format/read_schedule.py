"""Which rank reads each stored item of a load from storage, and who it sends it to: a pure
function of every rank's requests and of which files each rank can read (no process group;
`ckpt plan` calls it to predict a load's reads, the load's coordinator to plan them).

A *stored item* is one record of `.metadata` (a tensor chunk or an object) at ``(file, offset,
length)`` of a shard file. Replicated state (plain/DDP, HSDP's replicate dimension, DTensor
`Replicate`, objects such as param_groups, RankLocal entries every rank reads on a resize) has
items that several ranks ask for; without coordination each of them reads it from storage.
`schedule_reads` instead makes each such item *shared*: ONE rank reads it whole and sends its
raw bytes to the other ranks that need it (`shared_reads`, over `ckptlib.read_exchange`).

The rules:

- An item is read where it is needed (each requesting rank reads what it asks for, e.g. only
  the rows of a resharded load) when every requester can read its file and together they ask
  for no more bytes than the item holds (no duplication: a reshard's disjoint rows).
- Otherwise it is shared. Shared items go in *runs*: neighbours in one file with the same
  eligible readers, up to 1/world of the shared bytes each, so that a reader reads a few
  contiguous ranges (few GETs on an object store, no bytes between them). A run's reader is
  the requester with the fewest bytes to read so far (ties: the lower rank), among the
  requesters that can read its file; when none can, the least-loaded rank that can; when no
  rank can, `NoCopyError` (or, when copies of the file failed, `CopiesExhaustedError` naming
  them) for every rank. Runs are placed largest first, so the bytes spread evenly.
- Shared items go in rounds: a rank holds at most `round_bytes` of shared items (read or
  received) at a time, except an item larger than that, which travels in a round where its
  ranks hold nothing else.
- With `read_once=False` (or when some rank cannot exchange) every requester reads for itself
  (plain DCP's behaviour) and only items a requester cannot read are shared.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

from ..errors import CopiesExhaustedError, CopiesMissingError, NoCopyError
from .file_names import describe_file
from .item_decoder import DeclaredChunks

ItemKey = tuple[str, int, int]  # a stored item: (file, offset, length)

ROUND_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class LocalReads:
    """What a rank's local load plan tells the coordinator besides its items: the files it can
    read (None: every file), its copies' labels, and whether it takes part in shared reads."""

    readable: frozenset[str] | None = None
    labels: tuple[str, ...] = ()
    read_once: bool = True
    can_exchange: bool = False


@dataclasses.dataclass(frozen=True)
class RankRequests:
    """One rank's part of a load: the bytes it asks for of each stored item (an item's length
    when it needs all of it), and the files it can read (None: every file)."""

    items: Mapping[ItemKey, int]
    readable: frozenset[str] | None = None

    def can_read(self, name: str) -> bool:
        return self.readable is None or name in self.readable


@dataclasses.dataclass
class RoundRole:
    """One rank's part of one round: the items it reads whole, those it sends (to whom) and
    those it receives (from whom), each list in the order the round lists its items."""

    reads: list[ItemKey] = dataclasses.field(default_factory=list)
    sends: list[tuple[ItemKey, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    recvs: list[tuple[ItemKey, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RankRole:
    """What one rank does in a load (`ReadSchedule.role`): travels in its load plan."""

    rounds: list[RoundRole]
    shared: frozenset[ItemKey]  # items this rank needs that reach it through a round
    bytes_needed: int
    labels: tuple[str, ...] = ()  # every rank's copy labels, in one order (the accounting's)
    tight: frozenset[str] = frozenset()  # files whose gaps between this rank's items others read


@dataclasses.dataclass
class ReadSchedule:
    """The reads of a load: items each rank reads where needed (`direct`), shared items'
    readers and receivers, and the rounds that carry them."""

    world: int
    direct: list[dict[ItemKey, int]]  # per rank: item -> bytes it reads of it
    readers: dict[ItemKey, int]
    receivers: dict[ItemKey, tuple[int, ...]]
    rounds: list[list[ItemKey]]
    bytes_needed: int  # the distinct items any rank asks for, each counted once
    tight: list[frozenset[str]] = dataclasses.field(default_factory=list)  # per rank (`_tight`)

    def storage_bytes(self) -> list[int]:
        """The bytes each rank reads from storage (direct reads by the bytes asked for: a
        verified partial read adds the checksum blocks around them)."""
        out = [sum(d.values()) for d in self.direct]
        for key, reader in self.readers.items():
            out[reader] += key[2]
        return out

    def role(self, rank: int, labels: tuple[str, ...] = ()) -> RankRole:
        rounds, shared = [], set()
        for items in self.rounds:
            part = RoundRole()
            for key in items:
                reader, receivers = self.readers[key], self.receivers[key]
                if reader == rank:
                    part.reads.append(key)
                    if receivers:
                        part.sends.append((key, receivers))
                    shared.add(key)
                elif rank in receivers:
                    part.recvs.append((key, reader))
                    shared.add(key)
            if part.reads or part.recvs:
                rounds.append(part)
        tight = self.tight[rank] if self.tight else frozenset()
        return RankRole(rounds, frozenset(shared), self.bytes_needed, labels, tight)


def _no_reader(name: str, ranks: list[int], tried: Mapping[str, Sequence[tuple]]) -> Exception:
    who = ", ".join(map(str, ranks[:16])) + (f" ... ({len(ranks)} ranks)" if len(ranks) > 16 else "")
    failed = list(tried.get(name, ()))
    if failed:
        shown = "; ".join(f"{label} {uri}: {problem}" for label, uri, problem in failed)
        cls = CopiesMissingError if all("missing" in problem for *_, problem in failed) else CopiesExhaustedError
        return cls(
            f"every copy of {describe_file(name)} failed (needed by rank{'s' if len(ranks) > 1 else ''} {who}): "
            f"{shown}",
            file=name,
            tried=failed,
            path=failed[0][1],
        )
    return NoCopyError(
        f"no rank of this load has a copy of {describe_file(name)}, which rank{'s' if len(ranks) > 1 else ''} "
        f"{who} need{'' if len(ranks) > 1 else 's'}",
        path=name,
    )


def schedule_reads(
    requests: Sequence[RankRequests],
    *,
    read_once: bool = True,
    round_bytes: int = ROUND_BYTES,
    tried: Mapping[str, Sequence[tuple]] | None = None,
) -> ReadSchedule:
    """The reads of a load whose rank r asks for `requests[r]` (see the module). `tried`: the
    copies of each file already found bad ((label, uri, problem), for the error)."""
    world = len(requests)
    wanted: dict[ItemKey, list[tuple[int, int]]] = defaultdict(list)
    for rank, req in enumerate(requests):
        for key, nbytes in req.items.items():
            wanted[key].append((rank, nbytes))
    direct: list[dict[ItemKey, int]] = [{} for _ in range(world)]
    shared: list[tuple[ItemKey, list[int], list[int]]] = []  # (item, requesters, eligible readers)
    for key, who in wanted.items():
        name = key[0]
        able = [rank for rank, _ in who if requests[rank].can_read(name)]
        if len(able) == len(who) and (not read_once or len(who) == 1 or sum(n for _, n in who) <= key[2]):
            for rank, nbytes in who:
                direct[rank][key] = nbytes
            continue
        if not able:
            able = [rank for rank in range(world) if requests[rank].can_read(name)]
            if not able:
                raise _no_reader(name, sorted(rank for rank, _ in who), tried or {})
        if not read_once:  # only those that cannot read it are served
            for rank, nbytes in who:
                if requests[rank].can_read(name):
                    direct[rank][key] = nbytes
            who = [(rank, n) for rank, n in who if not requests[rank].can_read(name)]
        shared.append((key, [rank for rank, _ in who], able))
    load = [sum(d.values()) for d in direct]
    readers: dict[ItemKey, int] = {}
    receivers: dict[ItemKey, tuple[int, ...]] = {}
    runs = _runs(shared, min(round_bytes, -(-sum(key[2] for key, _, _ in shared) // max(world, 1))))
    runs.sort(key=lambda run: (-sum(key[2] for key, _, _ in run), run[0][0]))
    for run in runs:
        able = run[0][2]
        reader = min(able, key=lambda rank: (load[rank], rank))
        for key, who, _ in run:
            load[reader] += key[2] - direct[reader].pop(key, 0)  # (read_once=False: it reads the item once, whole)
            readers[key] = reader
            receivers[key] = tuple(rank for rank in who if rank != reader)
    rounds = _rounds([(key, readers[key], receivers[key]) for run in runs for key, _, _ in run], round_bytes)
    needed = sum(key[2] for key in wanted)
    return ReadSchedule(world, direct, readers, receivers, rounds, needed, _tight(direct, readers))


def _tight(direct: list[dict[ItemKey, int]], readers: dict[ItemKey, int]) -> list[frozenset[str]]:
    """Per rank, the files in which another rank reads items lying between this rank's own
    direct reads: there a rank must not read through the gaps between its items (an object
    store's coalesced GETs do, to save requests), or those bytes come from storage twice."""
    by_file: dict[str, list[tuple[int, int]]] = defaultdict(list)  # file -> (offset, reading rank)
    for rank, items in enumerate(direct):
        for key in items:
            by_file[key[0]].append((key[1], rank))
    for key, rank in readers.items():
        by_file[key[0]].append((key[1], rank))
    for reads in by_file.values():
        reads.sort()
    tight: list[set[str]] = [set() for _ in direct]
    for rank, items in enumerate(direct):
        extents: dict[str, list[int]] = {}
        for name, offset, _ in items:
            lo_hi = extents.setdefault(name, [offset, offset])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], offset), max(lo_hi[1], offset)
        for name, (lo, hi) in extents.items():
            reads = by_file[name]
            start = bisect.bisect_left(reads, (lo, -1))
            for offset, reader in itertools.islice(reads, start, None):
                if offset > hi:
                    break
                if reader != rank:
                    tight[rank].add(name)
                    break
    return [frozenset(t) for t in tight]


def _runs(shared: list[tuple[ItemKey, list[int], list[int]]], target: int) -> list[list[tuple]]:
    """Shared items as runs of neighbours in one file with the same eligible readers, each of
    at most `target` bytes (an item larger than that alone): one reader reads a run, so on an
    object store its items come in a few ranged GETs rather than one each, or whole spans."""
    runs: list[list[tuple]] = []
    size = 0
    for entry in sorted(shared, key=lambda e: (e[0][0], e[0][1])):
        key = entry[0]
        last = runs[-1][-1] if runs else None
        if last is not None and last[0][0] == key[0] and last[2] == entry[2] and size + key[2] <= target:
            runs[-1].append(entry)
            size += key[2]
        else:
            runs.append([entry])
            size = key[2]
    return runs


def _rounds(items: list[tuple[ItemKey, int, tuple[int, ...]]], cap: int) -> list[list[ItemKey]]:
    """Shared items (largest first) into rounds, each rank holding at most `cap` bytes of them
    in a round (an item larger than `cap` in a round where its ranks hold nothing else)."""
    rounds: list[list[ItemKey]] = []
    held: list[dict[int, int]] = []
    first_open: dict[int, int] = defaultdict(int)  # rank -> the first round it may still fit in
    for key, reader, dsts in items:
        ranks = (reader, *dsts)
        size = key[2]
        index = max((first_open[r] for r in ranks), default=0)
        while index < len(rounds):
            used = held[index]
            if all(used.get(r, 0) + size <= cap for r in ranks) or all(r not in used for r in ranks):
                break
            index += 1
        if index == len(rounds):
            rounds.append([])
            held.append({})
        rounds[index].append(key)
        for r in ranks:
            held[index][r] = held[index].get(r, 0) + size
            if held[index][r] >= cap:
                first_open[r] = max(first_open[r], index + 1)
    return rounds


def requests_from_plans(
    plans: Sequence[Any], storage_data: Mapping[Any, Any], declared: Callable, readable: Sequence[Any] | None = None
) -> list[RankRequests]:
    """Every rank's `RankRequests` from its local load plan: the stored item of each read item
    (`.metadata`'s `storage_data`) and the bytes it asks for (`declared(fqn, offsets)`: a
    stored chunk's (dtype, sizes)); `readable`: per rank, the files it can read (None: all)."""
    out = []
    for rank, plan in enumerate(plans):
        items: dict[ItemKey, int] = {}
        for req in plan.items:
            record = storage_data[req.storage_index]
            key = (record.relative_path, record.offset, record.length)
            chunk = declared(req.storage_index.fqn, req.storage_index.offset)
            whole, itemsize = (None, 1) if chunk is None else (chunk[1], chunk[0].itemsize)
            nbytes = requested_bytes(req.lengths, whole, record.length, itemsize)
            items[key] = min(record.length, items.get(key, 0) + nbytes)
        out.append(RankRequests(items, None if readable is None else readable[rank]))
    return out


def predict_reads(
    plans: Sequence[Any],
    metadata: Any,
    *,
    readable: Sequence[frozenset[str] | None] | None = None,
    read_once: bool = True,
    round_bytes: int = ROUND_BYTES,
) -> ReadSchedule:
    """What a load would read, without loading (for `ckpt plan`): `plans` are each rank's
    local DCP load plans (e.g. made by the load planner for simulated ranks), `metadata` the
    checkpoint's `.metadata`, `readable` the files each rank can read (None: every file)."""
    requests = requests_from_plans(plans, metadata.storage_data, DeclaredChunks(metadata).declared, readable)
    return schedule_reads(requests, read_once=read_once and len(plans) > 1, round_bytes=round_bytes)


def plan_roles(
    plans: Sequence[Any], storage_data: Mapping[Any, Any], declared: Callable, tried: Mapping[str, Sequence[tuple]]
) -> list[RankRole]:
    """The coordinator's step: every rank's local load plan (items, and `LocalReads` as its
    storage_data) -> each rank's `RankRole`."""
    infos = [p.storage_data if isinstance(p.storage_data, LocalReads) else LocalReads() for p in plans]
    requests = requests_from_plans(plans, storage_data, declared, [info.readable for info in infos])
    read_once = len(plans) > 1 and all(i.read_once and i.can_exchange for i in infos)
    schedule = schedule_reads(requests, read_once=read_once, tried=tried)
    labels = tuple(sorted({label for info in infos for label in info.labels}))
    return [schedule.role(rank, labels) for rank in range(len(plans))]


def requested_bytes(lengths: Sequence[int], whole: Sequence[int] | None, item_length: int, itemsize: int) -> int:
    """The bytes a read of `lengths` of a stored chunk of shape `whole` asks for: the item's
    length when it is the whole chunk (or an object), else the elements' bytes."""
    if whole is None or tuple(lengths) == tuple(whole):
        return item_length
    return min(item_length, math.prod(lengths) * itemsize)


__all__ = [
    "ROUND_BYTES",
    "ItemKey",
    "LocalReads",
    "RankRequests",
    "RankRole",
    "ReadSchedule",
    "RoundRole",
    "plan_roles",
    "schedule_reads",
]
