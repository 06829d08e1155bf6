"""Which rank reads each stored item of a load from storage, and who it sends it to: a pure
function of every rank's requests and of which files each rank can read (no process group;
`ckpt plan` calls it to predict a load's reads, the load's coordinator to plan them).

A *stored item* is one record of `.metadata` (a tensor chunk or an object) at ``(file, offset,
length)`` of a shard file. Replicated state (plain/DDP, HSDP's replicate dimension, DTensor
`Replicate`, objects such as param_groups, RankLocal entries every rank reads on a resize) has
items that several ranks ask for; without coordination each of them reads it from storage.
`schedule_reads` instead makes each such item *shared*: ONE rank reads it whole and sends its
raw bytes to the other ranks that need it (`shared_reads`, over `ckptlib.loading.read_exchange`).

The rules:

- Each rank says how far its nearest copy of each file is (`RankRequests.cost`: a node's local
  root is nearer than a peer's replica, which is nearer than the remote; `copies.COSTS`).
  Every item is read from the nearest copy any rank holds.
- An item is read where it is needed (each requesting rank reads what it asks for, e.g. only
  the rows of a resharded load) when every requester holds the nearest copy of its file and
  together they ask for no more bytes than the item holds (no duplication: a reshard's
  disjoint rows).
- Otherwise it is shared. Shared items go in *runs*: neighbours in one file with the same
  requesters and eligible readers, up to 1/world of the shared bytes each (at least
  `MIN_RUN`, at most `round_bytes`), so that a reader reads a few contiguous ranges (few GETs
  on an object store, no bytes between them) and sends a few large messages, one per *block*
  of adjacent items, not one per item. A run's reader is the requester with the fewest bytes
  to read so far (ties: the lower rank), among the requesters holding the nearest copy; when
  none does, the least-loaded rank that does; when no rank has a copy, `NoCopyError` (or,
  when copies of the file failed, `CopiesExhaustedError` naming them) for every rank. Runs
  are placed largest first, so the bytes spread evenly.
- Blocks go in rounds: a rank holds at most `round_bytes` of them (read or received) at a
  time, except an item larger than that, which travels in a round where its ranks hold
  nothing else.
- With `read_once=False` (or when some rank cannot exchange) every requester reads for itself
  from its own nearest copy (plain DCP's behaviour) and only items a requester has no copy of
  are shared.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

from ckptlib.errors import CheckpointError, CopiesExhaustedError, CopiesMissingError, NoCopyError
from ckptlib.format.items.item_decoder import DeclaredChunks
from ckptlib.format.native.file_names import describe_file

ItemKey = tuple[str, int, int]  # a stored item: (file, offset, length)

ROUND_BYTES = 256 << 20
# A run is at least this large (when there is that much to share): with many ranks and a small
# checkpoint, fewer readers and messages rather than world x world tiny ones.
MIN_RUN = 1 << 20


@dataclasses.dataclass(frozen=True)
class LocalReads:
    """What a rank's local load plan tells the coordinator besides its items: the copies it can
    read (`Copies.access`: per-file costs and a default), their labels, and whether it takes
    part in shared reads."""

    costs: Mapping[str, int] = dataclasses.field(default_factory=dict)
    default_cost: int | None = 0
    labels: tuple[str, ...] = ()
    read_once: bool = True
    can_exchange: bool = False


@dataclasses.dataclass(frozen=True)
class RankRequests:
    """One rank's part of a load: the bytes it asks for of each stored item (an item's length
    when it needs all of it), and how far its nearest copy of each file is: `costs[file]`, else
    `default_cost` (None: it has no copy of the other files)."""

    items: Mapping[ItemKey, int]
    costs: Mapping[str, int] = dataclasses.field(default_factory=dict)
    default_cost: int | None = 0

    @classmethod
    def reading(cls, items: Mapping[ItemKey, int], readable: frozenset[str] | None) -> "RankRequests":
        """A rank that can read `readable` (None: every file), all at one cost."""
        return cls(items) if readable is None else cls(items, dict.fromkeys(readable, 0), None)

    def cost(self, name: str) -> int | None:
        """How far this rank's nearest copy of file `name` is; None: it has none."""
        return self.costs.get(name, self.default_cost)


class _Nearest:
    """The nearest copy of each file over all ranks, and the ranks that hold it (computed from
    the ranks' costs and defaults, without visiting every (rank, file) pair)."""

    def __init__(self, requests: Sequence[RankRequests]):
        self.requests = requests
        defaults = [r.default_cost for r in requests if r.default_cost is not None]
        self.default = min(defaults) if defaults else None
        self.explicit: dict[str, int] = {}
        for req in requests:
            for name, cost in req.costs.items():
                if cost < self.explicit.get(name, cost + 1):
                    self.explicit[name] = cost
        self._holders: dict[str, list[int]] = {}

    def cost(self, name: str) -> int | None:
        found = self.explicit.get(name)
        if self.default is None:
            return found
        return self.default if found is None else min(found, self.default)

    def holders(self, name: str) -> list[int]:
        """The ranks with a copy of `name` at its nearest cost."""
        if name not in self._holders:
            best = self.cost(name)
            self._holders[name] = [
                r for r, req in enumerate(self.requests) if best is not None and req.cost(name) == best
            ]
        return self._holders[name]


# A block: adjacent shared items of one file, read whole by one rank and sent to the same ranks
# as one message: (reader, receivers, items in file order).
Block = tuple[int, tuple[int, ...], tuple[ItemKey, ...]]


def block_span(block: Block) -> tuple[str, int, int]:
    """(file, offset, length) of a block's bytes."""
    items = block[2]
    return items[0][0], items[0][1], items[-1][1] + items[-1][2] - items[0][1]


@dataclasses.dataclass
class RoundRole:
    """One rank's part of one round: the blocks it reads (and sends to their receivers) and
    the blocks it receives (from their readers), each in the order the round lists them."""

    out: list[Block] = dataclasses.field(default_factory=list)
    into: list[Block] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RankRole:
    """What one rank does in a load (`ReadSchedule.roles`): travels in its load plan."""

    rounds: list[RoundRole]
    shared: frozenset[ItemKey]  # items this rank reads or receives in a round (not where needed)
    bytes_needed: int
    labels: tuple[str, ...] = ()  # every rank's copy labels, in one order (the accounting's)
    tight: frozenset[str] = frozenset()  # files whose gaps between this rank's items others read
    read_once: bool = True  # the load reads shared items once (every rank asked for it)


@dataclasses.dataclass
class ReadSchedule:
    """The reads of a load: items each rank reads where needed (`direct`), shared items'
    readers and receivers, and the rounds of blocks that carry them."""

    world: int
    direct: list[dict[ItemKey, int]]  # per rank: item -> bytes it reads of it
    readers: dict[ItemKey, int]
    receivers: dict[ItemKey, tuple[int, ...]]
    rounds: list[list[Block]]
    bytes_needed: int  # the distinct items any rank asks for, each counted once
    tight: list[frozenset[str]] = dataclasses.field(default_factory=list)  # per rank (`_tight`)

    def storage_bytes(self) -> list[int]:
        """The bytes each rank reads from storage (direct reads by the bytes asked for: a
        verified partial read adds the checksum blocks around them)."""
        out = [sum(d.values()) for d in self.direct]
        for key, reader in self.readers.items():
            out[reader] += key[2]
        return out

    def roles(self, labels: tuple[str, ...] = (), read_once: bool = True) -> list[RankRole]:
        """Every rank's part, in one pass over the rounds."""
        rounds: list[list[RoundRole]] = [[] for _ in range(self.world)]
        shared: list[set[ItemKey]] = [set() for _ in range(self.world)]
        for blocks in self.rounds:
            parts: dict[int, RoundRole] = {}
            for block in blocks:
                reader, receivers, items = block
                parts.setdefault(reader, RoundRole()).out.append(block)
                shared[reader].update(items)
                for rank in receivers:
                    parts.setdefault(rank, RoundRole()).into.append(block)
                    shared[rank].update(items)
            for rank, part in parts.items():
                rounds[rank].append(part)
        return [
            RankRole(
                rounds[rank],
                frozenset(shared[rank]),
                self.bytes_needed,
                labels,
                self.tight[rank] if self.tight else frozenset(),
                read_once,
            )
            for rank in range(self.world)
        ]


def _duplicated(who: list[tuple[int, int]], length: int) -> bool:
    """Whether the requesters together ask for more bytes than the item holds (stops early:
    two whole-item requests are enough)."""
    total = 0
    for _, nbytes in who:
        total += nbytes
        if total > length:
            return True
    return False


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
    first: dict[ItemKey, int] = {}  # item -> its first requester (most items have one: a shard)
    more: dict[ItemKey, list[tuple[int, int]]] = {}  # item -> every requester, when several
    for rank, req in enumerate(requests):
        for key in req.items:
            found = first.setdefault(key, rank)
            if found != rank:
                more.setdefault(key, [(found, requests[found].items[key])]).append((rank, req.items[key]))
    direct: list[dict[ItemKey, int]] = [{} for _ in range(world)]
    shared: list[tuple[ItemKey, list[int], list[int]]] = []  # (item, requesters, eligible readers)
    nearest = _Nearest(requests)
    for key, rank in first.items():
        name = key[0]
        best = nearest.cost(name)
        if key not in more and best is not None and requests[rank].cost(name) == best:
            direct[rank][key] = requests[rank].items[key]  # the common case: one requester, nearest
            continue
        who = more.get(key) or [(rank, requests[rank].items[key])]
        if best is None:
            raise _no_reader(name, sorted(r for r, _ in who), tried or {})
        if not read_once:  # each requester with a copy reads its own; only the others are served
            for r, nbytes in who:
                if requests[r].cost(name) is not None:
                    direct[r][key] = nbytes
            who = [(r, n) for r, n in who if requests[r].cost(name) is None]
            if not who:
                continue
            shared.append((key, [r for r, _ in who], nearest.holders(name)))
            continue
        able = [r for r, _ in who if requests[r].cost(name) == best]  # requesters holding the nearest copy
        if len(able) == len(who) and not _duplicated(who, key[2]):
            for r, nbytes in who:
                direct[r][key] = nbytes
            continue
        shared.append((key, [r for r, _ in who], able or nearest.holders(name)))
    load = [sum(d.values()) for d in direct]
    readers: dict[ItemKey, int] = {}
    receivers: dict[ItemKey, tuple[int, ...]] = {}
    total = sum(key[2] for key, _, _ in shared)
    runs = _runs(shared, min(round_bytes, max(MIN_RUN, -(-total // max(world, 1)))))
    runs.sort(key=lambda run: (-sum(key[2] for key, _, _ in run), run[0][0]))
    blocks: list[Block] = []
    for run in runs:
        able = run[0][2]
        reader = min(able, key=lambda rank: (load[rank], rank))
        dsts = tuple(rank for rank in run[0][1] if rank != reader)
        for key, _, _ in run:
            load[reader] += key[2] - direct[reader].pop(key, 0)  # (read_once=False: it reads the item once, whole)
            readers[key] = reader
            receivers[key] = dsts
        blocks += _blocks(reader, dsts, [key for key, _, _ in run])
    rounds = _rounds(blocks, round_bytes)
    needed = sum(key[2] for key in first)
    return ReadSchedule(world, direct, readers, receivers, rounds, needed, _tight(direct, readers))


def _tight(direct: list[dict[ItemKey, int]], readers: dict[ItemKey, int]) -> list[frozenset[str]]:
    """Per rank, the files in which items lie between this rank's own direct reads that it does
    not read directly (another rank's, or a shared item, which is read in a block): there the
    rank must not read through the gaps between its items (an object store's coalesced GETs
    do, to save requests), or those bytes come from storage twice."""
    by_file: dict[str, list[tuple[int, int]]] = defaultdict(list)  # file -> (offset, direct reader or -1)
    for rank, items in enumerate(direct):
        for key in items:
            by_file[key[0]].append((key[1], rank))
    for key in readers:
        by_file[key[0]].append((key[1], -1))
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
            for offset, reader in itertools.islice(reads, bisect.bisect_left(reads, (lo, -2)), None):
                if offset > hi:
                    break
                if reader != rank:
                    tight[rank].add(name)
                    break
    return [frozenset(t) for t in tight]


def _runs(shared: list[tuple[ItemKey, list[int], list[int]]], target: int) -> list[list[tuple]]:
    """Shared items as runs of neighbours in one file with the same requesters and eligible
    readers, each of at most `target` bytes (an item larger than that alone): one reader reads
    a run, so on an object store its items come in a few ranged GETs, not one each, and the
    ranks exchange a few large messages, not one per item."""
    runs: list[list[tuple]] = []
    size = 0
    for entry in sorted(shared, key=lambda e: (e[0][0], e[0][1])):
        key = entry[0]
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last[0][0] == key[0]
            and last[1] == entry[1]
            and last[2] == entry[2]
            and size + key[2] <= target
        ):
            runs[-1].append(entry)
            size += key[2]
        else:
            runs.append([entry])
            size = key[2]
    return runs


def _blocks(reader: int, receivers: tuple[int, ...], items: list[ItemKey]) -> list[Block]:
    """A run's items (in file order) cut where they are not adjacent: each block is one read."""
    blocks: list[list[ItemKey]] = []
    for key in items:
        if blocks and blocks[-1][-1][1] + blocks[-1][-1][2] == key[1]:
            blocks[-1].append(key)
        else:
            blocks.append([key])
    return [(reader, receivers, tuple(b)) for b in blocks]


def _rounds(blocks: list[Block], cap: int) -> list[list[Block]]:
    """Blocks into rounds, each rank holding at most `cap` bytes of them in a round (a block
    larger than `cap` in a round where its ranks hold nothing else)."""
    rounds: list[list[Block]] = []
    held: list[dict[int, int]] = []
    first_open: dict[int, int] = defaultdict(int)  # rank -> the first round it may still fit in
    for block in blocks:
        reader, dsts, _ = block
        ranks = (reader, *dsts)
        size = block_span(block)[2]
        index = max((first_open[r] for r in ranks), default=0)
        while index < len(rounds):
            used = held[index]
            if all(used.get(r, 0) + size <= cap for r in ranks) or all(r not in used for r in ranks):
                break
            index += 1
        if index == len(rounds):
            rounds.append([])
            held.append({})
        rounds[index].append(block)
        for r in ranks:
            held[index][r] = held[index].get(r, 0) + size
            if held[index][r] >= cap:
                first_open[r] = max(first_open[r], index + 1)
    return rounds


def requests_from_plans(
    plans: Sequence[Any], storage_data: Mapping[Any, Any], declared: Callable, access: Sequence[Any] | None = None
) -> list[RankRequests]:
    """Every rank's `RankRequests` from its local load plan: the stored item of each read item
    (`.metadata`'s `storage_data`) and the bytes it asks for (`declared(fqn, offsets)`: a
    stored chunk's (dtype, sizes)); `access`: per rank, (costs, default cost) of its copies
    (`Copies.access`; None: every rank reads every file at one cost)."""
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
        costs, default = ({}, 0) if access is None else access[rank]
        out.append(RankRequests(items, costs, default))
    return out


def predict_reads(
    plans: Sequence[Any],
    metadata: Any,
    *,
    copies: Sequence[Any] | None = None,
    read_once: bool = True,
    round_bytes: int = ROUND_BYTES,
) -> ReadSchedule:
    """What a load would read, without loading (for `ckpt plan`): `plans` are each rank's
    local DCP load plans (e.g. made by the load planner for simulated ranks), `metadata` the
    checkpoint's `.metadata`, `copies` each rank's `format.copies.Copies` (None: every rank
    reads every file from one place, a plain load)."""
    access = None
    if copies is not None:
        names = {record.relative_path for record in metadata.storage_data.values()}
        access = [c.access(lambda: names) for c in copies]
    requests = requests_from_plans(plans, metadata.storage_data, DeclaredChunks(metadata).declared, access)
    return schedule_reads(requests, read_once=read_once and len(plans) > 1, round_bytes=round_bytes)


def plan_roles(
    plans: Sequence[Any], storage_data: Mapping[Any, Any], declared: Callable, tried: Mapping[str, Sequence[tuple]]
) -> list[RankRole]:
    """The coordinator's step: every rank's local load plan (items, and `LocalReads` as its
    storage_data) -> each rank's `RankRole`."""
    infos = [p.storage_data if isinstance(p.storage_data, LocalReads) else LocalReads() for p in plans]
    requests = requests_from_plans(plans, storage_data, declared, [(i.costs, i.default_cost) for i in infos])
    read_once = len(plans) > 1 and all(i.read_once and i.can_exchange for i in infos)
    schedule = schedule_reads(requests, read_once=read_once, tried=tried)
    unable = [rank for rank, info in enumerate(infos) if not info.can_exchange]
    if schedule.rounds and unable:
        raise CheckpointError(
            f"this load must send items between ranks (some rank has no copy of a file), but rank {unable[0]} "
            "cannot: load through ckptlib.load, which gives every rank the exchange"
        )
    return schedule.roles(tuple(sorted({label for info in infos for label in info.labels})), read_once)


def requested_bytes(lengths: Sequence[int], whole: Sequence[int] | None, item_length: int, itemsize: int) -> int:
    """The bytes a read of `lengths` of a stored chunk of shape `whole` asks for: the item's
    length when it is the whole chunk (or an object), else the elements' bytes."""
    if whole is None or tuple(lengths) == tuple(whole):
        return item_length
    return min(item_length, math.prod(lengths) * itemsize)


__all__ = [
    "MIN_RUN",
    "ROUND_BYTES",
    "Block",
    "ItemKey",
    "LocalReads",
    "RankRequests",
    "RankRole",
    "ReadSchedule",
    "RoundRole",
    "block_span",
    "plan_roles",
    "predict_reads",
    "requests_from_plans",
    "schedule_reads",
]
