"""Collective helpers that make one rank's failure an error on every rank, never a hang.

Every decision that could differ between ranks (does the path exist, is the checkpoint
committed, did my shard write succeed) goes through `agree` or `decide_on_rank0`, so all
ranks either continue together or raise the same ckptlib error together. Without a
process group every helper degrades to a plain local call.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import traceback
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from ckptlib._runtime import world as _world
from ckptlib.errors import (
    CheckpointError,
    NotCalledByEveryRankError,
    RankInterruptedError,
    RankLostError,
    stacklevel_outside_ckptlib,
)

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def barrier(group=None) -> None:
    if is_distributed():
        dist.barrier(group=group)


def _as_checkpoint_error(exc: BaseException, rank: int) -> CheckpointError:
    """Keep ckptlib errors as they are; wrap anything else so its type and rank survive."""
    if isinstance(exc, CheckpointError):
        if exc.rank is None:
            exc.rank = rank
        return exc
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return CheckpointError(f"rank {rank}: {detail}", rank=rank)


def portable_error(exc: BaseException, rank: int) -> CheckpointError:
    """An exception that is safe to pickle to other ranks."""
    err = _as_checkpoint_error(exc, rank)
    try:
        import pickle

        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return CheckpointError(f"rank {rank}: {err}", rank=rank)


class InterruptedCollective(Exception):
    """Carries a KeyboardInterrupt or SystemExit out of a rank's step inside a DCP collective,
    which gathers only `Exception`s: so the other ranks learn of it instead of waiting, and the
    rank that got it raises it again as itself (`unwrap_dcp_error`)."""

    def __init__(self, interrupt: BaseException):
        super().__init__(f"{type(interrupt).__name__}")
        self.interrupt = interrupt

    def __reduce__(self):
        return (type(self), (self.interrupt,))


def _flag_device(group) -> torch.device:
    """Where a collective's tensor must live for this group's backend (NCCL: the current GPU)."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Ballot(Protocol):
    """Numbers every rank puts into an agreement round: `votes` (as many on every rank, set
    by `fn`) are reduced with MAX in the round's one all_reduce and handed to `counted`."""

    votes: list[int]

    def counted(self, reduced: list[int]) -> None: ...


def agree(
    fn: Callable[[], T],
    group=None,
    ballot: Ballot | None = None,
    *,
    same: Callable[[T], int] | None = None,
    disagree: Callable[[list[int]], CheckpointError] | None = None,
    every_pair: bool = False,
) -> T:
    """Run `fn` on every rank; if it raised on any rank, raise on every rank.

    Every rank raises a CheckpointError: the failing rank its own (chained to the original
    exception), the others the first failing rank's, which names that rank. `ballot`'s votes
    ride in the same all_reduce (no extra round); it is counted only if nobody failed.

    `same(result)`: an int64 every rank's result must give alike (a step); when they differ,
    every rank raises `disagree(values)`, `values` every rank's int in rank order. It rides on
    the same all_reduce (the maximum of the value and of its negation), so agreeing costs no
    round of its own; the values are gathered only when they differ.

    `every_pair=True` (without a ballot): the ranks exchange their outcome all-to-all instead
    of through a reduction, so when a rank has died every survivor's collective fails at once
    (in a reduction only the dead rank's neighbours see it; the others wait for them to exit).
    For agreements that wait long (on other ranks' uploads) in a background pipeline.
    """
    if same is None:
        return _agree(fn, group, ballot, None, every_pair=every_pair)[0]
    assert disagree is not None and not every_pair
    check = _SameValue(same, disagree, group, ballot)
    return _agree(lambda: check.judged(fn()), group, check, None)[0]


class _SameValue:
    """A Ballot whose last two votes are an int and its negation: after the MAX reduction they
    are the largest and (negated) the smallest value of any rank, alike only when all are."""

    def __init__(self, same: Callable[[Any], int], disagree: Callable[[list[int]], CheckpointError], group, inner):
        self.same, self.disagree, self.group, self.inner = same, disagree, group, inner
        self.value = 0

    def judged(self, result: T) -> T:
        self.value = int(self.same(result))
        return result

    @property
    def votes(self) -> list[int]:
        return [*([] if self.inner is None else self.inner.votes), self.value, -self.value]

    def counted(self, reduced: list[int]) -> None:
        if self.inner is not None:
            self.inner.counted(reduced[:-2])
        if reduced[-2] != -reduced[-1]:
            values: list[Any] = [None] * get_world_size(self.group)
            dist.all_gather_object(values, self.value, group=self.group)
            raise self.disagree(values)


def agree_sharing(fn: Callable[[], T], values: Sequence[int], group=None) -> tuple[T, list[list[int]]]:
    """`agree`, whose one collective also gathers `values` (as many ints on every rank) from
    every rank: figures the ranks report together once they agree (a load's bytes read), for
    no round of their own. Returns fn's result and every rank's values, by rank."""
    return _agree(fn, group, None, [int(v) for v in values])


def _agree(
    fn: Callable[[], T], group, ballot: Ballot | None, values: list[int] | None, *, every_pair: bool = False
) -> tuple[T, list[list[int]]]:
    result: Any = None
    local_error: BaseException | None = None
    interrupt: BaseException | None = None
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
        if not is_distributed():
            raise
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # re-raised as itself here, named to the others
            interrupt = exc
            rank = dist.get_rank()
            exc = RankInterruptedError(f"rank {rank} was interrupted ({type(exc).__name__})", ranks=[rank], rank=rank)
        local_error = exc
    if not is_distributed():
        if ballot is not None:
            ballot.counted(list(ballot.votes))
        return result, [list(values or [])]
    # The common case, nobody failed, costs one tiny all_reduce (an all_gather when values are
    # shared; an all_to_all with every_pair); the errors themselves are gathered (two more
    # rounds: sizes, then payloads) only when some rank failed.
    flag = 0 if local_error is None else 1
    device = _flag_device(group)
    rows: list[list[int]] = []
    if every_pair and ballot is None and values is None:
        world = get_world_size(group)
        received = torch.zeros(world, dtype=torch.int32)
        dist.all_to_all_single(received, torch.full((world,), flag, dtype=torch.int32), group=group)
        any_failed = bool(received.max().item())
    elif values is None:
        votes = [] if ballot is None else list(ballot.votes)
        dtype = torch.int32 if ballot is None else torch.int64
        failed = torch.tensor([flag, *votes], dtype=dtype, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        any_failed = bool(failed[0].item())
        if not any_failed and ballot is not None:
            ballot.counted(failed[1:].tolist())
    else:
        mine = torch.tensor([flag, *values], dtype=torch.int64, device=device)
        gathered_rows = [torch.empty_like(mine) for _ in range(get_world_size(group))]
        dist.all_gather(gathered_rows, mine, group=group)
        rows = [row.tolist() for row in gathered_rows]
        any_failed = any(row[0] for row in rows)
        rows = [row[1:] for row in rows]
    if not any_failed:
        return result, rows
    portable = None if local_error is None else portable_error(local_error, dist.get_rank())
    gathered: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(gathered, portable, group=group)
    if interrupt is not None:
        raise interrupt.with_traceback(None) from None
    if local_error is not None:
        if portable is local_error:
            raise local_error
        raise portable from local_error
    for err in gathered:
        if err is not None:
            raise err
    return result, rows


def agreement(group=None) -> Callable[[Callable[[], Any]], Any] | None:
    """`agree` on `group` as a callable (for `state.CollectiveSteps`); None in a single process."""
    return (lambda fn: agree(fn, group)) if is_distributed() else None


def decide_on_rank0(fn: Callable[[], T], group=None) -> T:
    """Run `fn` on group rank 0 only and hand its result (or its error) to every rank."""
    if not is_distributed():
        return fn()
    payload: list[Any] = [None]
    if get_rank(group) == 0:
        try:
            payload[0] = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
            payload[0] = ("error", portable_error(exc, dist.get_rank()))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(payload, src=src, group=group)
    status, value = payload[0]
    if status == "error":
        raise value
    return value


def warn_once(message: str, category: type[Warning], group=None) -> None:
    """A warning every rank of `group` would give alike (decided on rank 0, or agreed), given
    once per job: by its rank 0 only, not once per rank (`FreshStartWarning` on 64 ranks was 64
    lines)."""
    if is_distributed() and get_rank(group) != 0:
        return
    import warnings

    warnings.warn(message, category, stacklevel=stacklevel_outside_ckptlib())


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj`, in group rank order (`[obj]` in a single process)."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def decide_on(fn: Callable[[], T], src: int, group=None) -> T:
    """`decide_on_rank0` with group rank `src` deciding: `fn` runs there only, and its result
    (or its error) reaches every rank."""
    if not is_distributed():
        return fn()
    payload: list[Any] = [None]
    if get_rank(group) == src:
        try:
            payload[0] = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on every rank
            payload[0] = ("error", portable_error(exc, dist.get_rank()))
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    status, value = payload[0]
    if status == "error":
        raise value
    return value


# Seconds the survivors of a broken collective wait for each other's roll call in the store.
ROLL_CALL_SECONDS = 5.0
# What gloo (and the store) say when a peer's process is gone or its socket broke.
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "read error",
    "write error",
    "connection refused",
    "socket closed",
    "no route to host",
    "timed out",
    "timeout",
)
_guards: dict[str, "itertools.count[int]"] = {}


def _is_timeout(exc: BaseException) -> bool:
    """Whether a collective failed because its peers never came (not because one broke)."""
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def _is_peer_loss(exc: BaseException) -> bool:
    """A failure of the transport under a collective, not of ckptlib or the user's state
    (those reach the guard as CheckpointErrors: `agree` and DCP's error gathering wrap them)."""
    if isinstance(exc, CheckpointError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if not isinstance(exc, RuntimeError) and not (dist_error and isinstance(exc, dist_error)):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_LOST_MARKERS)


def _roll_call(group, key: str, wait_s: float, alive: list[int] | None = None) -> list[int] | None:
    """Global ranks of `group` that did not check in under `key` in the rendezvous store within
    `wait_s` seconds and whose heartbeat stopped meanwhile (a survivor still blocked in the
    broken collective, waiting on a peer that is itself in this roll call, is alive: its
    heartbeat counter moves; those are appended to `alive`); None when the store itself is
    unreachable (its host is gone too)."""
    from ckptlib._torch import c10d

    try:
        store = c10d.default_store()
        ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
        store.set(f"{key}/{dist.get_rank()}", "1")
        beats = {r: store.add(f"{_HEARTBEAT_KEY}/{r}", 0) for r in ranks}
        deadline = time.monotonic() + max(wait_s, 3 * _HEARTBEAT_SECONDS)
        while True:
            absent = [r for r in ranks if not store.check([f"{key}/{r}"])]
            if not absent:
                return absent
            if time.monotonic() > deadline:
                dead = [r for r in absent if store.add(f"{_HEARTBEAT_KEY}/{r}", 0) == beats[r]]
                if alive is not None:
                    alive.extend(r for r in absent if r not in dead)
                return dead
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone: say so instead of naming ranks
        return None


def _check_in(call: str, what: str, group, *, step, path) -> None:
    from ckptlib._runtime.check_in import check_in
    from ckptlib._torch import c10d

    try:
        store = c10d.default_store()
        ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    except Exception:  # noqa: BLE001 - no store to check in at: the collectives' own checks remain
        return
    _world.generation()  # a new world's serials start at 0 (`_forget_world`)
    # counted per group: its ranks make its calls equally often, as they make its collectives
    serial = next(_entries.setdefault((call, tuple(ranks)), itertools.count()))
    check_in(store, call, what, serial, ranks, (_HEARTBEAT_KEY, _HEARTBEAT_SECONDS), path=path, step=step)


# Every process in a guarded collective beats in the store: a counter its own thread adds to
# each second, so a roll call tells a dead rank (no beat) from one blocked in gloo (beating).
_HEARTBEAT_KEY = "ckptlib/heartbeat"
_HEARTBEAT_SECONDS = 1.0
_heartbeats: dict[int, threading.Event] = {}  # pid whose heartbeat runs (not inherited by a fork) -> its stop


def start_heartbeat() -> None:
    """This process's heartbeat thread, once (on a clone of the store: its own connection);
    nothing without a process group."""
    import os

    from ckptlib._torch import c10d

    if not is_distributed():
        return
    _world.generation()  # a new world stops the old one's heartbeat (`_forget_world`)
    with _heartbeat_lock:
        if os.getpid() in _heartbeats:
            return
        stop = _heartbeats[os.getpid()] = threading.Event()
    try:
        store = c10d.default_store().clone()
    except Exception:  # noqa: BLE001 - no store to beat in: roll calls fall back to check-ins
        return
    key = f"{_HEARTBEAT_KEY}/{dist.get_rank()}"

    def beat() -> None:
        while not stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return
            stop.wait(_HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="ckptlib-heartbeat", daemon=True).start()


_depth = threading.local()  # how many guards and public calls this thread is inside
_entries: dict[tuple, "itertools.count[int]"] = {}  # public calls made, by (kind, group ranks): check-in keys
_heartbeat_lock = threading.Lock()


def _forget_world() -> None:
    """A new world (`_runtime.world`): its store holds none of the old one's keys, so the check-in
    and roll-call serials start at 0 again (where a process that joins it starts them), and the
    heartbeat moves to its store."""
    _entries.clear()
    _guards.clear()
    with _heartbeat_lock:
        for stop in _heartbeats.values():
            stop.set()
        _heartbeats.clear()


_world.on_new_world(_forget_world)


@contextlib.contextmanager
def called_by_every_rank(
    call: str, what: str, group=None, *, step: int | None = None, path: str | None = None
) -> Iterator[None]:
    """A public collective call (`save`, `load`, a manager's save), before its first collective:
    check that every rank of `group` makes it (`check_in`: NotCalledByEveryRankError in
    seconds, not at the process group's timeout). Inside another such call or a guard of this
    thread (a load inside the cluster tier's inventory) nothing more is checked."""
    depth = getattr(_depth, "n", 0)
    check_every_rank_calls(call, what, group, step=step, path=path)
    _depth.n = depth + 1
    try:
        yield
    finally:
        _depth.n = depth


def check_every_rank_calls(
    call: str, what: str, group=None, *, step: int | None = None, path: str | None = None
) -> None:
    """`called_by_every_rank`'s check alone, for a call that makes no other public call inside.
    `call` names the kind of call ("save", "load": ranks may pass different paths, their own
    node's) and keys the check-in; `what` describes it in the error. A `group` of a world this
    process left is a ProcessGroupError first (`world.check_group`)."""
    _world.check_group(group, what)
    if getattr(_depth, "n", 0) == 0 and is_distributed():
        start_heartbeat()
        _check_in(call, what, group, step=step, path=path)


@contextlib.contextmanager
def peer_loss_as_error(what: str, group=None, *, step: int | None = None, path: str | None = None) -> Iterator[None]:
    """Turn a broken collective under `what` (e.g. "save of step 2 to /ckpt") into a
    RankLostError naming the ranks that disappeared, found by a roll call in the store.

    Every rank enters it for the same `what` equally often (like the collectives it guards):
    the roll call's key is `what` and how many times this process entered it before.
    """
    start_heartbeat()  # first: a new world's serials start at 0
    serial = next(_guards.setdefault(what, itertools.count()))
    depth = getattr(_depth, "n", 0)
    _depth.n = depth + 1
    try:
        yield
    except RankLostError:
        raise
    except BaseException as exc:
        if not is_distributed() or not _is_peer_loss(exc):
            raise
        elsewhere: list[int] = []
        absent = _roll_call(group, f"ckptlib/roll_call/{what}/{serial}", ROLL_CALL_SECONDS, elsewhere)
        if absent == [] and elsewhere and _is_timeout(exc):
            names = ", ".join(map(str, elsewhere))
            raise NotCalledByEveryRankError(
                f"{what} failed on rank {dist.get_rank()}: it is a collective call, which every rank must make, "
                f"and rank{'s' if len(elsewhere) > 1 else ''} {names} (alive) did not make it within the process "
                "group's timeout",
                ranks=elsewhere,
                path=path,
                rank=dist.get_rank(),
            ) from exc
        if absent is None:
            who = "a peer rank disappeared (the rendezvous store is unreachable as well)"
        elif absent:
            names = ", ".join(map(str, absent))
            who = (
                f"rank{'s' if len(absent) > 1 else ''} {names} disappeared (died, or lost its connection: "
                f"no answer within {ROLL_CALL_SECONDS:.0f} s)"
            )
        else:
            who = "a connection between ranks broke, though every rank is still alive"
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[0]
        raise RankLostError(
            f"{what} failed on rank {dist.get_rank()}: {who} ({detail})",
            ranks=absent or (),
            step=step,
            path=path,
            rank=dist.get_rank(),
        ) from exc
    finally:
        _depth.n = depth
