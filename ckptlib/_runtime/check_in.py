"""A collective call made by some ranks only fails in seconds, not at the process group's timeout.

Every rank entering a public collective (`save`, `async_save`, `load`, a manager's save) checks
in under the call's name in the rendezvous store before its first collective: one counter
increment; the last to arrive sets a key the others wait on (one blocking wait). That is the
whole cost when the ranks come within `LIVENESS_AFTER_SECONDS` of each other: two store
operations per rank, whatever the group's size. A rank still waiting after that appends its
rank to the call's list once (so that a rank giving up can name who did not come) and waits on.
A rank whose group has not all checked in within `CKPTLIB_CALL_GRACE` seconds (default 60)
raises NotCalledByEveryRankError naming the ranks that did not call. Nothing tells a rank
that died before the call from one that is alive and not calling (no rank beats a heartbeat):
both are named at the grace; a rank lost during a call is named within seconds by the roll
call (`roll_call`).

A check-in is one generation: a rank that gives up on it first records why under the check-in
and adds ABANDONED to its counter, in one atomic step that also tells it whether the last rank
came meanwhile (then the call goes on, on every rank). A rank arriving after that (a
latecomer, whose counter then reads past ABANDONED) never completes it: it raises
NotCalledByEveryRankError at once, naming the ranks that gave up and the ranks they waited for,
instead of walking into the call's collectives alone and blocking there until the process
group's timeout. Every rank keeps counting its calls, so the next call pairs up again.

Without a store, with a one-rank group or `CKPTLIB_CALL_GRACE=0` nothing is checked: the
collective's own timeout and the roll call (`agree.peer_loss_as_error`) remain.
"""

from __future__ import annotations

import datetime
import os
import time
import zlib

import torch.distributed as dist

from ckptlib.errors import NotCalledByEveryRankError

DEFAULT_GRACE_SECONDS = 60.0
LIVENESS_AFTER_SECONDS = 3.0  # a rank waiting this long appends itself to the call's list
ABANDONED = 1 << 40  # what a rank giving up on a check-in adds to its counter (past any group size)


def grace_seconds() -> float:
    """`CKPTLIB_CALL_GRACE` (seconds; 0 turns the check-in off), DEFAULT_GRACE_SECONDS unset."""
    text = os.environ.get("CKPTLIB_CALL_GRACE", "")
    try:
        value = float(text) if text.strip() else DEFAULT_GRACE_SECONDS
    except ValueError:
        return DEFAULT_GRACE_SECONDS
    return max(value, 0.0)


def base_key(call: str, serial: int, ranks: list[int]) -> str:
    """The store keys of the `serial`-th call of kind `call` of the group of `ranks`."""
    tag = zlib.crc32(",".join(map(str, ranks)).encode())
    return f"ckptlib/check_in/{call}/{serial}/{tag:08x}"


def check_in(store, call: str, what: str, serial: int, ranks: list[int], *, path=None, step=None) -> None:
    """Wait until every rank of `ranks` (global ranks) made its `serial`-th call of kind `call`
    (described by `what` in errors); raise as the module says when some did not."""
    grace = grace_seconds()
    if grace <= 0 or len(ranks) <= 1:
        return
    me = dist.get_rank()
    base = base_key(call, serial, ranks)
    try:
        count = store.add(f"{base}/count", 1)
        if count >= ABANDONED:  # the others gave up on this call before this rank came
            abandoned = store.get(f"{base}/abandoned").decode()
        elif count >= len(ranks):
            store.set(f"{base}/all", "1")
            return
    except Exception:  # noqa: BLE001 - no usable store: the collectives' own checks remain
        return
    if count >= ABANDONED:
        raise _too_late(what, me, abandoned, path)
    started = time.monotonic()
    if _all_came(store, base, min(LIVENESS_AFTER_SECONDS, grace)):  # a grace shorter than that is kept
        return
    try:
        store.append(f"{base}/ranks", f"{me},")  # late: say who came, for a rank that gives up
    except Exception:  # noqa: BLE001
        return
    left = grace - (time.monotonic() - started)
    if left > 0 and _all_came(store, base, left):
        return
    try:
        arrived = _arrived(store, base)
        if store.add(f"{base}/count", 0) > len(arrived):  # some came in the last seconds, not yet listed
            if _all_came(store, base, LIVENESS_AFTER_SECONDS + 1.0):
                return
            arrived = _arrived(store, base)
    except Exception:  # noqa: BLE001
        return
    missing = [r for r in ranks if r not in arrived]
    if not missing or not _give_up(store, base, me, missing, grace, len(ranks)):
        return  # the last rank came meanwhile: the call goes on
    raise NotCalledByEveryRankError(
        f"{what} on rank {me}: it is a collective call, which every rank of its group must make, and "
        f"rank{'s' if len(missing) > 1 else ''} {_names(missing)} did not make it within "
        f"{grace:g} s (CKPTLIB_CALL_GRACE)",
        ranks=missing,
        path=path,
        rank=me,
    )


def _all_came(store, base: str, seconds: float) -> bool:
    """Whether the last rank set the call's key within `seconds` (True as well when the store
    is gone: the collective will say what happened)."""
    try:
        store.wait([f"{base}/all"], datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except Exception as exc:  # noqa: BLE001 - a timeout is the wait's way of saying "not yet"
        return "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower()


def _arrived(store, base: str) -> set[int]:
    return {int(r) for r in store.get(f"{base}/ranks").decode().split(",") if r}


def _give_up(store, base: str, me: int, missing: list[int], grace: float, size: int) -> bool:
    """Abandon the check-in at `base` (why first, for latecomers); False when all `size` ranks
    had checked in before (the call goes on), True when it is abandoned for good."""
    try:
        store.append(f"{base}/abandoned", f"{me}:{','.join(map(str, missing))}:{grace:g};")
        before = store.add(f"{base}/count", ABANDONED) - ABANDONED
    except Exception:  # noqa: BLE001 - the store is gone: give up, as the caller decided
        return True
    return not size <= before < ABANDONED


def _too_late(what: str, me: int, abandoned: str, path) -> NotCalledByEveryRankError:
    """The error of a rank that came to a check-in the others gave up on: `abandoned` holds
    each quitter's "rank:missing ranks:grace;" (the first one's missing ranks and grace named)."""
    entries = [entry.split(":") for entry in abandoned.split(";") if entry]
    quitters = sorted({int(entry[0]) for entry in entries})
    missing = [int(r) for r in entries[0][1].split(",") if r] if entries else [me]
    grace = entries[0][2] if entries else "?"
    return NotCalledByEveryRankError(
        f"{what} on rank {me}: it is a collective call, and rank{'s' if len(quitters) > 1 else ''} "
        f"{_names(quitters)} made it and gave up waiting for rank{'s' if len(missing) > 1 else ''} "
        f"{_names(missing)} after {grace} s (CKPTLIB_CALL_GRACE): this call came too late and runs none of its "
        "collectives",
        ranks=missing,
        path=path,
        rank=me,
    )


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (f" ... ({len(ranks)} in all)" if len(ranks) > 20 else "")


__all__ = ["ABANDONED", "DEFAULT_GRACE_SECONDS", "base_key", "check_in", "grace_seconds"]
