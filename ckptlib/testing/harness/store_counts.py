"""Count what ckptlib's calls cost a job, in one rank: operations on the rendezvous store (by
kind), process groups created, and ckptlib's threads alive.

    with counting() as counts:
        ckptlib.save(path, state)
    counts.store_ops, counts.by_kind, counts.groups, counts.new_threads()

`counting()` wraps the store ckptlib reaches through `ckptlib._torch.c10d.default_store` (every
store operation of ckptlib's, its second connections included: `clone()` counts into the same
`Counts`) and torch's group constructors (`new_group`, `split_group`, `new_subgroups`).
Operations torch makes itself on the store (a group's connections) are not ckptlib's calls: they
show as the groups counted. `Counts.new_threads()`: ckptlib's threads alive now that were not
when counting began.
Used by tests/api/test_store_costs.py and `ckpt bench`; imports torch only when entered.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Iterator

STORE_OPS = frozenset(
    {
        "set",
        "get",
        "add",
        "wait",
        "check",
        "append",
        "multi_get",
        "multi_set",
        "compare_set",
        "delete_key",
        "num_keys",
    }
)
GROUP_MAKERS = ("new_group", "split_group", "new_subgroups")


class Counts:
    """Store operations by kind and process groups made, since `counting()` was entered."""

    def __init__(self) -> None:
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.groups = 0
        self._lock = threading.Lock()
        self._threads_before = {t.ident for t in threading.enumerate()}

    def new_threads(self) -> list[str]:
        """ckptlib's threads alive now that were not when counting began (not the harness's own)."""
        return sorted(
            t.name
            for t in threading.enumerate()
            if t.name.startswith("ckptlib") and t.is_alive() and t.ident not in self._threads_before
        )

    @property
    def store_ops(self) -> int:
        return sum(self.by_kind.values())

    def mark(self) -> tuple[int, int]:
        """(store operations, groups) so far: `since(mark)` is what happened after it."""
        return self.store_ops, self.groups

    def since(self, mark: tuple[int, int]) -> tuple[int, int]:
        return self.store_ops - mark[0], self.groups - mark[1]

    def _count(self, kind: str) -> None:
        with self._lock:
            self.by_kind[kind] += 1


class CountingStore:
    """A c10d Store whose operations count into `counts` (a clone counts into the same)."""

    def __init__(self, store: Any, counts: Counts):
        self._store, self._counts = store, counts

    def clone(self) -> "CountingStore":
        return CountingStore(self._store.clone(), self._counts)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in STORE_OPS:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts._count(name)
            return attr(*args, **kwargs)

        return counted


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """Count this process's store operations (ckptlib's) and process groups made, inside."""
    import torch.distributed as dist

    from ckptlib._torch import c10d

    counts = Counts()
    real_store = c10d.default_store
    wrapped: dict[int, CountingStore] = {}

    def default_store() -> CountingStore:
        store = real_store()
        if id(store) not in wrapped:  # one wrapper per store: ckptlib keys its connections by it
            wrapped[id(store)] = CountingStore(store, counts)
        return wrapped[id(store)]

    originals = {name: getattr(dist, name) for name in GROUP_MAKERS if hasattr(dist, name)}

    def making(original):
        def make(*args: Any, **kwargs: Any) -> Any:
            counts.groups += 1
            return original(*args, **kwargs)

        return make

    c10d.default_store = default_store
    for name, original in originals.items():
        setattr(dist, name, making(original))
    try:
        yield counts
    finally:
        c10d.default_store = real_store
        for name, original in originals.items():
            setattr(dist, name, original)


__all__ = ["CountingStore", "Counts", "counting"]
