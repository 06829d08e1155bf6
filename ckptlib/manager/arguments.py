"""The arguments of a manager's collective calls that must match on every rank, agreed before
the first collective that depends on them.

A manager's save, load and gc take arguments that choose the collectives the call makes, or
what every rank does together: the step (a load of `step=None` asks rank 0 for the newest
step, one of a named step does not), `overwrite` (a save that may replace asks rank 0 whether
it replaces), `dry_run`. Ranks passing different values would run different collectives (a
hang, or one rank raising alone while the other blocks) or silently act on rank 0's value. So
each call first agrees them: one small all_reduce (MAX of every value and of its negation,
alike only when all ranks are), and where they differ, every rank raises the same
RanksDisagreeError naming each rank's value. `maybe_save`'s step rides on its decision round
(`policies.decide`) for no round of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ckptlib._runtime import agree as _dist
from ckptlib.errors import RanksDisagreeError
from ckptlib.format.write.plan_agreement import grouped


def encode(value: int | bool | None) -> int:
    """The int a value is compared as (-1: None, which no step or flag is)."""
    return -1 if value is None else int(value)


def _shown(name: str, value: int) -> str:
    if name == "step":
        return "no step" if value < 0 else str(value)
    return str(bool(value))


def disagreement(what: str, names: list[str], values: list[list[int]]) -> RanksDisagreeError:
    """The error for ranks that passed different `names` to the collective `what` ("save"):
    `values[r]` is rank r's encoded values, in `names`' order. The same text on every rank."""
    differ = [i for i, _ in enumerate(names) if len({row[i] for row in values}) > 1]
    clauses = [
        f"the {names[i]} of a collective {what}: "
        + grouped({r: _shown(names[i], row[i]) for r, row in enumerate(values)})
        for i in differ
    ]
    which = ", ".join(names[i] for i in differ)
    return RanksDisagreeError(
        f"ranks disagree on {'; and on '.join(clauses)}. Every rank must pass the same {which}; nothing was written, "
        "read or removed",
        ranks=list(range(len(values))),
        keys=[names[i] for i in differ],
        rank=_dist.get_rank(),
    )


def same_arguments(what: str, group=None, **arguments: int | bool | None) -> None:
    """Every rank of `group` passed the same `arguments` to the collective `what`; else
    RanksDisagreeError on every rank (one all_reduce; the values are gathered only when they
    differ). Nothing without a process group."""
    if not _dist.is_distributed():
        return
    names = list(arguments)
    mine = [encode(arguments[name]) for name in names]
    votes = torch.tensor(votes_of(mine), dtype=torch.int64, device=_dist._flag_device(group))
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    check_votes(what, names, mine, votes.tolist(), group)


def check_votes(what: str, names: list[str], mine: list[int], reduced: list[int], group) -> None:
    """After a MAX reduction of each value and its negation (`reduced`, in pairs): raise the
    disagreement on every rank when some pair differs (one all_gather of the values then)."""
    if all(reduced[2 * i] == -reduced[2 * i + 1] for i in range(len(names))):
        return
    raise disagreement(what, names, _dist.all_gather_object(mine, group))


def votes_of(mine: list[int]) -> list[int]:
    """The numbers `check_votes` expects reduced: each value and its negation."""
    return [v for value in mine for v in (value, -value)]


__all__ = ["check_votes", "disagreement", "encode", "same_arguments", "votes_of"]
