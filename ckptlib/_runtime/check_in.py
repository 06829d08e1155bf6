"""A collective call made by some ranks only fails in seconds, not at the process group's timeout.

Every rank entering a public collective (`save`, `async_save`, `load`, a manager's save) checks
in under the call's name in the rendezvous store before its first collective: one append of
its rank and one counter increment; the last to arrive sets a key the others wait on. A rank
whose group has not all checked in within `CKPTLIB_CALL_GRACE` seconds (default 60) raises
NotCalledByEveryRankError naming the ranks that did not call, which are alive (their
heartbeat counter moves, or never started); a missing rank whose heartbeat stopped is lost
(RankLostError, within a few seconds). Waiting costs no requests beyond the store's blocking
wait; the missing ranks are looked up only after the first seconds.

A check-in is one generation: a rank that gives up on it (either error) first records why under
the check-in and adds ABANDONED to its counter, in one atomic step that also tells it whether
the last rank came meanwhile (then the call goes on, on every rank). A rank arriving after that
(a latecomer, whose counter then reads past ABANDONED) never completes it: it raises
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

from ckptlib.errors import NotCalledByEveryRankError, RankLostError

DEFAULT_GRACE_SECONDS = 60.0
LIVENESS_AFTER_SECONDS = 3.0  # missing ranks' heartbeats are looked at after this long
MAX_LOOKED_AT = 64  # heartbeats read per look (the missing ranks of a huge group: the first)
ABANDONED = 1 << 40  # what a rank giving up on a check-in adds to its counter (past any group size)


def grace_seconds() -> float:
    """`CKPTLIB_CALL_GRACE` (seconds; 0 turns the check-in off), DEFAULT_GRACE_SECONDS unset."""
    text = os.environ.get("CKPTLIB_CALL_GRACE", "")
    try:
        value = float(text) if text.strip() else DEFAULT_GRACE_SECONDS
    except ValueError:
        return DEFAULT_GRACE_SECONDS
    return max(value, 0.0)


def check_in(
    store,
    call: str,
    what: str,
    serial: int,
    ranks: list[int],
    heartbeat: tuple[str, float],
    *,
    path=None,
    step=None,
) -> None:
    """Wait until every rank of `ranks` (global ranks) made its `serial`-th call of kind `call`
    (described by `what` in errors); raise as the module says when some did not. `heartbeat`:
    the store key prefix of the ranks' heartbeat counters and their period in seconds."""
    heartbeat_key, beat_seconds = heartbeat
    grace = grace_seconds()
    if grace <= 0 or len(ranks) <= 1:
        return
    me = dist.get_rank()
    tag = zlib.crc32(",".join(map(str, ranks)).encode())
    base = f"ckptlib/check_in/{call}/{serial}/{tag:08x}"
    try:
        store.append(f"{base}/ranks", f"{me},")
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
    seen: dict[int, tuple[int, float]] = {}  # a missing rank's heartbeat count, and since when
    while True:
        try:
            store.wait([f"{base}/all"], datetime.timedelta(seconds=1.0))
            return
        except Exception as exc:  # noqa: BLE001 - a timeout is the wait's way of saying "not yet"
            if "timeout" not in str(exc).lower():
                return  # the store is gone: the collective will say what happened
        now = time.monotonic()
        waited = now - started
        if waited < min(LIVENESS_AFTER_SECONDS, grace):  # a grace shorter than that is still kept
            continue
        try:
            arrived = {int(r) for r in store.get(f"{base}/ranks").decode().split(",") if r}
            missing = [r for r in ranks if r not in arrived]
            beats = {r: store.add(f"{heartbeat_key}/{r}", 0) for r in missing[:MAX_LOOKED_AT]}
        except Exception:  # noqa: BLE001
            return
        if not missing:
            continue  # the last one is setting the key
        for r, n in beats.items():
            if r not in seen or seen[r][0] != n:
                seen[r] = (n, now)
        # stopped: it beat once, then not for three beats (a rank that never beat is alive
        # somewhere that starts no heartbeat: it is judged at the grace)
        lost = [r for r, (n, since) in seen.items() if r in beats and n > 0 and now - since >= 3 * beat_seconds]
        if (lost or waited >= grace) and not _give_up(store, base, me, missing, grace, len(ranks)):
            continue  # the last rank came meanwhile: the call goes on
        if lost:
            raise RankLostError(
                f"{what} on rank {me}: rank{'s' if len(lost) > 1 else ''} {_names(lost)} disappeared before "
                f"making this collective call (its heartbeat stopped)",
                ranks=lost,
                step=step,
                path=path,
                rank=me,
            )
        if waited >= grace:
            raise NotCalledByEveryRankError(
                f"{what} on rank {me}: it is a collective call, which every rank of its group must make, and "
                f"rank{'s' if len(missing) > 1 else ''} {_names(missing)} (alive) did not make it within "
                f"{grace:g} s (CKPTLIB_CALL_GRACE)",
                ranks=missing,
                path=path,
                rank=me,
            )


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


__all__ = ["ABANDONED", "DEFAULT_GRACE_SECONDS", "check_in", "grace_seconds"]
