"""What the ranks of one save must agree on, checked on the coordinator from the local plans
DCP gathers anyway (no collective of its own), before anything is written.

Ranks may hold different keys (pipeline stages hold different modules; `RankLocal` entries
are per rank). A key several ranks hold must be the same kind on each (a tensor, a sharded
tensor, an object) with the same dtype and (global) shape: DCP keeps one rank's copy of a
replicated tensor, so a shape or dtype that differs would silently keep one of them. A
sharded tensor's pieces must cover it: pieces missing because ranks of its mesh lack the key
are named with the ranks that hold it. Either is `RanksDisagreeError` listing keys and ranks.
"""

from __future__ import annotations

import math
from typing import Iterable

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ckptlib._runtime import agree as _dist
from ckptlib.errors import RanksDisagreeError

SHOWN_KEYS = 10  # keys a message details (all are in the error's `keys`)


def describe_ranks(ranks: Iterable[int]) -> str:
    """ "rank 3", "ranks 0, 2-5": ranks in order, runs of three or more as ranges."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ordered[i]}-{ordered[j]}")
        else:
            parts.extend(str(r) for r in ordered[i : j + 1])
        i = j + 1
    return ("ranks " if len(ordered) > 1 else "rank ") + ", ".join(parts)


def grouped(values: dict[int, str]) -> str:
    """ "rank 0: a; ranks 1-3: b": each distinct value with the ranks that have it, in rank order."""
    by_value: dict[str, list[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(values[rank], []).append(rank)
    return "; ".join(f"{describe_ranks(ranks)}: {value}" for value, ranks in by_value.items())


def _describe(item) -> str:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return "object"
    data = item.tensor_data
    kind = "sharded" if item.type == WriteItemType.SHARD else "tensor"
    return f"{kind} {str(data.properties.dtype).removeprefix('torch.')} {tuple(data.size)}"


def _raise(problems: dict[str, str], ranks: set[int], what: str) -> None:
    keys = sorted(problems)
    shown = " | ".join(f"{key}: {problems[key]}" for key in keys[:SHOWN_KEYS])
    more = f" | ... ({len(keys)} keys in all)" if len(keys) > SHOWN_KEYS else ""
    raise RanksDisagreeError(
        f"ranks disagree on the state they save: {shown}{more}. {what}; nothing was written",
        ranks=sorted(ranks),
        keys=keys,
        rank=_dist.get_rank(),
    )


def check_plans(all_plans: list[SavePlan]) -> None:
    """Every key held by several ranks is the same kind, dtype and shape on each (all_plans[r] is
    rank r's local plan); RanksDisagreeError naming the keys and ranks otherwise."""
    first: dict[str, str] = {}
    held: dict[str, dict[int, str]] = {}
    differing: set[str] = set()
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            fqn = item.index.fqn
            desc = _describe(item)
            seen = first.setdefault(fqn, desc)
            held.setdefault(fqn, {})[rank] = desc
            if seen != desc:
                differing.add(fqn)
    if differing:
        ranks = {rank for fqn in differing for rank in held[fqn]}
        _raise(
            {fqn: grouped(held[fqn]) for fqn in differing},
            ranks,
            "A key several ranks hold must have the same kind, dtype and shape on each",
        )


def check_coverage(all_plans: list[SavePlan], metadata: Metadata) -> None:
    """Sharded tensors whose pieces do not add up to them because some ranks lack the key:
    RanksDisagreeError naming each with the ranks that hold it. A tensor every rank holds,
    overlaps and other plan errors are left to DCP's own check (and its own words)."""
    short = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and len(md.size):
            total = math.prod(md.size)
            covered = sum(math.prod(chunk.sizes) for chunk in md.chunks)
            if covered < total:
                short[fqn] = (md, covered, total)
    if not short:
        return
    holders: dict[str, set[int]] = {fqn: set() for fqn in short}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.index.fqn in holders:
                holders[item.index.fqn].add(rank)
    everyone = set(range(len(all_plans)))
    short = {fqn: found for fqn, found in short.items() if holders[fqn] != everyone}  # else DCP's to judge
    if not short:
        return
    problems = {}
    for fqn, (md, covered, total) in short.items():
        dtype = str(md.properties.dtype).removeprefix("torch.")
        problems[fqn] = (
            f"sharded {dtype} {tuple(md.size)} held by {describe_ranks(holders[fqn])} only, whose pieces cover "
            f"{covered} of its {total} elements"
        )
    _raise(
        problems,
        everyone,
        "Every rank of a sharded tensor's mesh must hold it (the same keys in the same order)",
    )


__all__ = ["check_coverage", "check_plans", "describe_ranks", "grouped"]
