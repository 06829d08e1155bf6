"""What every rank of a collective save or load must pass alike, beyond the state's keys (which
`format.plan_agreement` checks on the coordinator from DCP's plans): the step, agreed inside
an agreement round the call takes anyway (`_dist.agree(..., same=...)`, no round of its own).

Replicated values (a plain tensor or object every rank holds) are saved from one rank (the
one DCP's dedup picks to balance the writes), and values that differ between ranks are not
detected by default (comparing them costs a checksum of every replicated byte and a round). With
CKPTLIB_CHECK_REPLICAS=1 a save compares them and raises `RanksDisagreeError` naming the keys
and ranks, before anything is written: a debugging aid for a run whose ranks drifted apart.
"""

from __future__ import annotations

import os
import pickle
import zlib
from typing import Any, Callable

import torch

from ckptlib._runtime import agree as _dist
from ckptlib._torch import dcp_shims, probes
from ckptlib.errors import RanksDisagreeError
from ckptlib.format.write.plan_agreement import SHOWN_KEYS, grouped

CHECK_REPLICAS_ENV = "CKPTLIB_CHECK_REPLICAS"


def step_value(step: int | None) -> int:
    """A step as the int `_dist.agree(same=...)` compares (-1: no step)."""
    return -1 if step is None else step


def step_and_overwrite(step: int | None, overwrite: bool) -> int:
    """A save's step and `overwrite` as the one int `_dist.agree(same=...)` compares
    (`step_disagreement` takes either apart)."""
    return 2 * step_value(step) + int(bool(overwrite))


def step_disagreement(what: str) -> Callable[[list[int]], RanksDisagreeError]:
    """The error for ranks that passed different steps to `what` ("save": `step_and_overwrite`
    values, the overwrite= named when only it differs): the same text on every rank (each
    rank's own path may differ with its step, so none is named)."""

    def build(values: list[int]) -> RanksDisagreeError:
        steps = [v // 2 for v in values]
        if len(set(steps)) == 1:  # the steps agree: overwrite= does not
            name, shown = "overwrite", grouped({rank: str(bool(v % 2)) for rank, v in enumerate(values)})
        else:
            name, shown = "step", grouped({rank: str(v) if v >= 0 else "no step" for rank, v in enumerate(steps)})
        return RanksDisagreeError(
            f"ranks disagree on the {name} of a collective {what}: {shown}. Every rank must pass the same {name}; "
            "nothing was written or read",
            ranks=list(range(len(values))),
            keys=[name],
            rank=_dist.get_rank(),
        )

    return build


def replicas_checked() -> bool:
    return os.environ.get(CHECK_REPLICAS_ENV, "") not in ("", "0")


def _digest(value: Any) -> int | None:
    """A CRC-32 of a replicated value (None: a sharded value, each rank its own piece)."""
    dtensor = probes.dtensor_cls()
    if dtensor is not None and isinstance(value, dtensor):
        return None
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor or value.is_sparse or value.device.type == "meta":
            return None
        flat = value.detach().cpu().contiguous().reshape(-1)
        return zlib.crc32(memoryview(flat.view(torch.uint8).numpy())) if flat.numel() else 0
    if type(value).__name__ == "ShardedTensor":
        return None
    try:
        return zlib.crc32(pickle.dumps(value, protocol=4))
    except Exception:  # noqa: BLE001 - an unpicklable value fails the save elsewhere, by name
        return None


def check_replicas(state_dict: dict[str, Any], group, where: str) -> None:
    """Under CKPTLIB_CHECK_REPLICAS=1: every replicated value held by several ranks is the same
    on each, else RanksDisagreeError on every rank (collective: one all_gather)."""
    flat, _ = dcp_shims.flatten_state_dict(state_dict)
    mine = {key: d for key, d in ((key, _digest(v)) for key, v in flat.items()) if d is not None}
    every: list[Any] = [None] * _dist.get_world_size(group)
    torch.distributed.all_gather_object(every, mine, group=group)
    held: dict[str, dict[int, str]] = {}
    for rank, digests in enumerate(every):
        for key, digest in digests.items():
            held.setdefault(key, {})[rank] = f"crc32 {digest:08x}"
    differing = sorted(key for key, per in held.items() if len(set(per.values())) > 1)
    if not differing:
        return
    shown = " | ".join(f"{key}: {grouped(held[key])}" for key in differing[:SHOWN_KEYS])
    more = f" | ... ({len(differing)} keys in all)" if len(differing) > SHOWN_KEYS else ""
    raise RanksDisagreeError(
        f"{where}: replicated values differ between ranks ({CHECK_REPLICAS_ENV}=1): {shown}{more}. A value "
        "every rank holds is saved from one rank; nothing was written",
        ranks=sorted({rank for key in differing for rank in held[key]}),
        keys=differing,
        path=where,
        rank=_dist.get_rank(),
    )


__all__ = [
    "CHECK_REPLICAS_ENV",
    "check_replicas",
    "replicas_checked",
    "step_and_overwrite",
    "step_disagreement",
    "step_value",
]
