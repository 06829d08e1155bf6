"""Who is still there after a collective broke: the roll call in the rendezvous store, and the
watch that answers it for a rank blocked in a collective.

No rank beats a heartbeat: liveness is asked for only when a collective broke. Every public
collective call (`agree.called_by_every_rank`: a save, a load, a manager's save) is one `Call`
with its own keys in the store; while the call runs, one daemon thread of each rank (its
*watch*) blocks on the rank's wake key, on a second connection to the store, and answers a
roll call for a rank whose own thread is blocked in a collective (waiting on a survivor that
is itself in the roll call). The call's end sets that key, and the watch ends with the call:
no ckptlib thread is alive between calls. An async save's call goes on in the background:
its watch ends when the background save does (`hand_over` / `Call.end`).

A roll call (`roll_call`, after a collective failed with a broken connection or a timeout):
the first survivor in wakes every rank's watch (one `multi_set`); each rank answers once
(its main thread or its watch: one append of its rank and one increment; the last answer sets
the key the others wait on); each survivor waits on that key at most `wait_s` seconds, then
reads the answers once. Ranks that never answered are absent. A survivor whose collective broke
(not timed out) marks its answer: with such a mark the absent ranks are lost; with none (every
collective timed out) they are alive and did not make the call.

Store operations, per rank: a call's watch costs two (its wait and the end's set); a roll
call at most six (open, wake, append, increment, the last's set, the wait, and one read
of the answers when some rank did not answer), whatever the group's size. Without a store (or
a one-rank group) nothing is watched.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

from ckptlib._runtime import world as _world

WAKE_TIMEOUT = datetime.timedelta(days=7)  # a watch waits this long at most (it ends with its call)
JOIN_SECONDS = 5.0  # how long a call's end waits for its watch to go (a store that is gone)
_clones: dict[int, tuple[Any, Any]] = {}  # id(store) -> (store, its second connection: the watches')
_lock = threading.Lock()


def _forget_world() -> None:
    """A new world's store is another one: its watches open their connection anew."""
    with _lock:
        _clones.clear()


_world.on_new_world(_forget_world)


def _second_connection(store):
    """One more connection to `store` per process and world (a watch blocks on it)."""
    with _lock:
        found = _clones.get(id(store))
        if found is None or found[0] is not store:
            found = _clones[id(store)] = (store, store.clone())
        return found[1]


class Call:
    """One collective call of `ranks` (global ranks; this one is `me`) under store key `base`:
    its roll call's keys, and its watch while `watch()` ran and `end()` did not."""

    def __init__(self, store, base: str, ranks: list[int], me: int, *, watched: bool = False):
        self.store, self.base, self.ranks, self.me = store, base, ranks, me
        self.watched = watched  # its ranks watch it (a public call): a roll call wakes them
        self.handed_over = False  # its end belongs to a background (`agree.hand_over`)
        self._answered = False
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None

    def _wake_key(self, rank: int) -> str:
        return f"{self.base}/wake/{rank}"

    def watch(self) -> None:
        """Start this rank's watch (it answers a roll call while this call runs)."""
        if len(self.ranks) <= 1 or self._thread is not None:
            return
        try:
            second = _second_connection(self.store)
        except Exception:  # noqa: BLE001 - a store without clone(): survivors name what did not answer
            return
        self._thread = threading.Thread(target=self._wait, args=(second,), name="ckptlib-call-watch", daemon=True)
        self._thread.start()

    def _wait(self, second) -> None:
        try:
            second.wait([self._wake_key(self.me)], WAKE_TIMEOUT)
        except Exception:  # noqa: BLE001 - the store is gone, or the call outlived a week
            return
        if not self._ended.is_set():  # woken by a roll call, not by the call's end
            self.answer(second, broke=False)

    def end(self) -> None:
        """The call is over on this rank: its watch goes (one store set)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._ended.set()
        try:
            self.store.set(self._wake_key(self.me), "end")
        except Exception:  # noqa: BLE001 - the store is gone: the watch's wait fails as well
            pass
        thread.join(JOIN_SECONDS)

    def answer(self, store, *, broke: bool) -> None:
        """This rank's answer to the roll call (once, from whichever thread comes first)."""
        with self._lock:
            if self._answered:
                return
            self._answered = True
        try:
            store.append(f"{self.base}/roll/answers", f"{self.me}{'!' if broke else ''},")
            if store.add(f"{self.base}/roll/count", 1) >= len(self.ranks):
                store.set(f"{self.base}/roll/all", "1")
        except Exception:  # noqa: BLE001 - the store is gone: the survivors say so
            pass


def roll_call(call: Call, wait_s: float, *, broke: bool) -> tuple[list[int], bool] | None:
    """The ranks of `call` that did not answer within `wait_s` seconds, and whether any survivor's
    collective broke (`broke`: this one's did); None when the store itself is unreachable."""
    store = call.store
    try:
        if call.watched and store.add(f"{call.base}/roll/opened", 1) == 1:
            others = [call._wake_key(r) for r in call.ranks if r != call.me]
            if others and hasattr(store, "multi_set"):
                store.multi_set(others, ["roll"] * len(others))
            else:  # a torch before Store.multi_set
                for key in others:
                    store.set(key, "roll")
        call.answer(store, broke=broke)
        try:
            store.wait([f"{call.base}/roll/all"], datetime.timedelta(seconds=wait_s))
            return [], broke  # every rank answered
        except Exception as exc:  # noqa: BLE001 - a timeout: some rank did not answer
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                return None
        answers = [a for a in store.get(f"{call.base}/roll/answers").decode().split(",") if a]
    except Exception:  # noqa: BLE001 - the store is gone: say so instead of naming ranks
        return None
    answered = {int(a.rstrip("!")) for a in answers}
    return [r for r in call.ranks if r not in answered], broke or any(a.endswith("!") for a in answers)


__all__ = ["Call", "roll_call"]
