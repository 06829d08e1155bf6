"""The checkpointer protocol: what the harness needs of a checkpointer to prove it.

Both calls are collective: every rank calls them, with the state the harness built on that
rank (``{"model": module, "optim": optimizer, ...}``, as ``ckpt validate --spec`` builds it).
``save(root, step, state)`` writes step ``step`` under ``root``; ``load(root, state)`` fills
``state`` in place from the newest step under ``root`` the checkpointer considers committed and
returns that step, or None for a root without one (a fresh start).

Optional attributes:
- ``carries``: the names of the state entries it promises to restore (default: every entry);
  the harness checks what is promised and reports the rest as not carried.
- ``async_save(root, step, state)``: returns an object with ``wait()``; the harness proves it too.
- ``name``: how reports call it (default: the reference it was resolved from).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from ckptlib.errors import CheckpointError


class CheckpointerError(CheckpointError):
    """A ``--checkpointer`` reference that does not name a usable checkpointer."""


@runtime_checkable
class Checkpointer(Protocol):
    def save(self, root: str, step: int, state: dict) -> None: ...

    def load(self, root: str, state: dict) -> int | None: ...


def resolve(ref: Any) -> Checkpointer:
    """A checkpointer from `ref`: an object with save/load, a zero-argument factory returning
    one, or a ``"module:attr"`` string naming either."""
    target = ref
    if isinstance(ref, str):
        module_name, sep, attr = ref.partition(":")
        if not sep or not module_name or not attr:
            raise CheckpointerError(f"checkpointer {ref!r}: expected 'module:attr'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise CheckpointerError(f"checkpointer {ref!r}: cannot import {module_name!r}: {exc}") from exc
        try:
            target = getattr(module, attr)
        except AttributeError as exc:
            raise CheckpointerError(f"checkpointer {ref!r}: module {module_name!r} has no {attr!r}") from exc
    if isinstance(target, type) or (not isinstance(target, Checkpointer) and callable(target)):
        target = target()
    if not isinstance(target, Checkpointer):
        raise CheckpointerError(
            f"checkpointer {ref!r}: {type(target).__name__} has no save(root, step, state) and load(root, state)"
        )
    return target
