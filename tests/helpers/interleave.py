"""Forced interleavings of two writers or a reader and a writer on one local root: an
`Interleaved` storage runs another process's whole action just before its own k-th storage
operation, so a test can enumerate every k (never a timing-dependent race).

    storage = Interleaved(root, at=k, interrupt=lambda: other_manager.save(6, state))
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ckptlib.storage import LocalStorage

OPERATIONS = (
    "read",
    "list",
    "list_children",
    "exists",
    "is_file",
    "read_pointer",
    "direct_read_path",
    "create_exclusive",
    "write",
    "delete",
    "delete_tree",
    "set_pointer",
)


class Interleaved(LocalStorage):
    """LocalStorage (and its children, sharing one count) that calls `interrupt()` once, just
    before the operation numbered `at` (0-based); `ops` records (operation, path below the
    root, first str argument) in order."""

    def __init__(self, root: str, at: int | None, interrupt: Callable[[], Any], *, _shared: dict | None = None):
        super().__init__(root)
        self.shared = _shared if _shared is not None else {"ops": [], "at": at, "interrupt": interrupt, "done": False}
        self.base = root if _shared is None else _shared["base"]
        self.shared.setdefault("base", self.base)

    @property
    def ops(self) -> list[tuple]:
        return self.shared["ops"]

    @property
    def interrupted(self) -> bool:
        return self.shared["done"]

    def child(self, name: str) -> "Interleaved":
        return Interleaved(os.path.join(self.local_path(), name), None, lambda: None, _shared=self.shared)

    def _before(self, op: str, args: tuple) -> None:
        shared = self.shared
        where = os.path.relpath(self.local_path(), shared["base"])
        first = next((a for a in args if isinstance(a, str)), None)
        if len(shared["ops"]) == shared["at"] and not shared["done"]:
            shared["done"] = True
            shared["interrupt"]()
        shared["ops"].append((op, where, first))


def _hooked(name: str):
    def method(self, *args, **kwargs):
        self._before(name, args)
        return getattr(LocalStorage, name)(self, *args, **kwargs)

    method.__name__ = name
    return method


for _name in OPERATIONS:
    setattr(Interleaved, _name, _hooked(_name))


def run_at_every_operation(make: Callable[[int | None], tuple[Interleaved, Callable[[], Any]]]) -> list[tuple]:
    """Run the action `make(k)` returns (its storage and a callable) once undisturbed and then with
    the interruption before each of its operations k in turn; returns [(k, op, outcome)], the
    outcome what the action returned or the exception it raised (the undisturbed run as k=None)."""
    storage, action = make(None)
    outcomes = [(None, None, _outcome(action))]
    count = len(storage.ops)
    for k in range(count + 1):
        storage, action = make(k)
        outcome = _outcome(action)
        ops = storage.ops
        outcomes.append((k, ops[k] if k < len(ops) else "after the last", outcome))
    return outcomes


def _outcome(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return exc


class InterleavedProxy:
    """Any Storage (an object store's as well as a local one), wrapped like `Interleaved`: calls
    `interrupt()` once, just before its (and its children's) operation numbered `at`."""

    def __init__(self, inner: Any, at: int | None, interrupt: Callable[[], Any], *, _shared: dict | None = None):
        self.inner = inner
        self.shared = _shared if _shared is not None else {"ops": [], "at": at, "interrupt": interrupt, "done": False}
        self.shared.setdefault("base", inner.uri.rstrip("/"))

    @property
    def ops(self) -> list[tuple]:
        return self.shared["ops"]

    def _where(self) -> str:
        """This storage's path below the wrapped root ("." for the root), as `Interleaved` says it."""
        base, uri = self.shared["base"], self.inner.uri.rstrip("/")
        return "." if uri == base else uri[len(base) + 1 :]

    def child(self, name: str) -> "InterleavedProxy":
        return InterleavedProxy(self.inner.child(name), None, lambda: None, _shared=self.shared)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in OPERATIONS:
            return attr

        def operation(*args, **kwargs):
            shared = self.shared
            if len(shared["ops"]) == shared["at"] and not shared["done"]:
                shared["done"] = True
                shared["interrupt"]()
            shared["ops"].append((name, self._where(), next((a for a in args if isinstance(a, str)), None)))
            return attr(*args, **kwargs)

        return operation
