"""The checkpointer protocol: what the harness needs of a checkpointer to prove it.

Both calls are collective: every rank calls them, with the state the harness built on that
rank (``{"model": module, "optim": optimizer, ...}``, as ``ckpt validate --spec`` builds it).
``save(root, step, state)`` writes step ``step`` under ``root``; ``load(root, state)`` fills
``state`` in place from the newest step under ``root`` the checkpointer considers committed and
returns that step, or None for a root without one (a fresh start).

Optional attributes:
- ``carries``: the names of the state entries it promises to restore (default: every entry),
  or a function of the state returning them (a checkpointer that restores what it can tell by
  type, e.g. everything but ``ckptlib.RankLocal`` per-rank state); the harness checks what is
  promised and reports the rest as not carried (:func:`carried`).
- a ``process_group`` keyword on ``save`` and ``load``: the harness runs each (N, M) pair on a
  subgroup of the first N (or M) ranks and passes it (None: the whole world); for a
  checkpointer without it, that subgroup is made the default process group during the call
  (:func:`save_on` / :func:`load_on`).
- ``async_save(root, step, state)``: returns an object with ``wait()``; the harness proves it too.
- ``name``: how reports call it (default: the reference it was resolved from).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

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


def carried(checkpointer: Any, state: dict) -> frozenset[str]:
    """The entries of `state` that `checkpointer` promises to restore (its ``carries``: names,
    or a function of the state; default every entry). Names it lists that `state` lacks are
    left out; a ``carries`` that is not a collection of names is a CheckpointerError."""
    promise = getattr(checkpointer, "carries", None)
    if promise is None:
        return frozenset(state)
    if callable(promise):
        promise = promise(state)
    if isinstance(promise, (str, bytes)) or not isinstance(promise, Iterable):
        raise CheckpointerError(
            f"checkpointer {describe(checkpointer)}: carries must name state entries, got {promise!r}"
        )
    names = frozenset(promise)
    if not all(isinstance(name, str) for name in names):
        raise CheckpointerError(
            f"checkpointer {describe(checkpointer)}: carries must name state entries, got {promise!r}"
        )
    return names & frozenset(state)


def describe(checkpointer: Any) -> str:
    """How reports name `checkpointer`: its ``name``, else its type's module:qualname."""
    name = getattr(checkpointer, "name", None)
    if isinstance(name, str) and name:
        return name
    kind = type(checkpointer)
    return f"{kind.__module__}:{kind.__qualname__}"


def takes_group(checkpointer: Any) -> bool:
    """Whether both of its calls take a ``process_group`` keyword (or ``**kwargs``)."""

    def accepts(fn: Any) -> bool:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return False
        return any(p.name == "process_group" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    return accepts(checkpointer.save) and accepts(checkpointer.load)


@contextlib.contextmanager
def _as_default_group(group: Any) -> Iterator[None]:
    """`group` as the default process group for the duration: a checkpointer that takes no
    process_group (it calls collectives on the default group, asks ``dist.get_world_size()``)
    sees a world of the pair's ranks. ``dist.new_group`` inside it is not supported."""
    import torch.distributed as dist

    world = dist.GroupMember.WORLD
    dist.GroupMember.WORLD = group
    try:
        yield
    finally:
        dist.GroupMember.WORLD = world


def _on(checkpointer: Any, group: Any, call: Callable[..., Any]) -> Any:
    if takes_group(checkpointer):
        return call(process_group=group)
    if group is None:
        return call()
    with _as_default_group(group):
        return call()


def save_on(checkpointer: Any, root: str, step: int, state: dict, group: Any = None) -> None:
    """``checkpointer.save(root, step, state)`` on `group` (None: the default group): passed as
    ``process_group=`` where its save takes one, else made the default group meanwhile."""
    _on(checkpointer, group, lambda **kw: checkpointer.save(root, step, state, **kw))


def load_on(checkpointer: Any, root: str, state: dict, group: Any = None) -> int | None:
    """``checkpointer.load(root, state)`` on `group`, as `save_on`; the step it says it resumed."""
    return _on(checkpointer, group, lambda **kw: checkpointer.load(root, state, **kw))
