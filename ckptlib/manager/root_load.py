"""Loading one step of a CheckpointManager root while other processes may delete it.

Another process's retention (or `ckpt gc`) can delete the step a load is reading: the
directory vanishes between listing and reading, or a shard between planning and reading.
That step is gone, not damaged, so the load never reports it as corruption: a load that
resumes from `latest` retries on the step `latest` names now; a load of a named step raises
`CheckpointRemovedError` saying it was removed. Rank 0 decides (one round, only after a
failure), so every rank retries or raises alike. A step the caller named is the same on every
rank: the manager agreed it before (`manager.arguments`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ckptlib._runtime import agree as _dist
from ckptlib.errors import CheckpointError, CheckpointNotFoundError, CheckpointRemovedError, StateError
from ckptlib.format.native.layout import classify
from ckptlib.format.native.root import step_dir
from ckptlib.loading.loading import LoadResult, load
from ckptlib.storage.base import Storage


def load_initial(
    uri: str, only: Sequence[str] | None, state: Mapping[str, Any], group, kwargs: dict[str, Any]
) -> LoadResult:
    """Load `uri` into `state`: the entries `only` names, by default the state's modules."""
    import torch.nn as nn

    if "only" not in kwargs:
        if only is None:
            only = tuple(name for name, value in state.items() if isinstance(value, nn.Module))
            if not only:
                raise StateError(
                    f"initial_load={uri!r} loads the state's nn.Module entries, and the state has "
                    "none; pass initial_load_only=(names...)"
                )
        kwargs = {**kwargs, "only": only}
    try:
        return load(uri, state, process_group=group, **kwargs)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(f"initial_load {uri!r} does not exist ({exc})", path=uri) from exc


RETRIES = 3  # how many newer `latest` steps a resuming load tries after the one it read was removed


def load_step(
    storage: Storage,
    root_uri: str,
    state: Mapping[str, Any],
    step: int,
    *,
    latest: Callable[[], int | None] | None,
    group,
    options: dict[str, Any],
) -> tuple[int, LoadResult]:
    """Load `step` of the root at `storage` into `state`: (the step loaded, its LoadResult).

    `latest` (None for a step the caller named): the step to retry on when this one was
    removed during the load. A named step is the same on every rank (the manager agreed it)."""
    kind = "committed" if latest is not None else _dist.decide_on_rank0(lambda: _kind(storage, step), group)
    if kind == "missing":
        raise CheckpointNotFoundError(f"{root_uri} has no step {step}", path=_where(root_uri, step))
    attempt = 0
    while True:
        try:
            result = load(storage.child(step_dir(step)), state, process_group=group, **options)
        except (CheckpointError, OSError) as exc:
            now = _dist.decide_on_rank0(lambda: _kind(storage, step), group)
            if now == kind or kind not in ("committed", "dcp"):  # still there: a real failure
                if now == "missing":
                    raise CheckpointNotFoundError(
                        f"{root_uri} has no step {step}", path=_where(root_uri, step)
                    ) from exc
                if isinstance(exc, CheckpointError):
                    raise
                where = _where(root_uri, step)
                raise CheckpointError(f"{where}: {type(exc).__name__}: {exc}", path=where) from exc
            newer = latest() if latest is not None and attempt < RETRIES else None
            if newer is None or newer == step:
                gone = f". {root_uri} has no committed step now" if latest is not None and newer is None else ""
                raise CheckpointRemovedError(
                    f"{_where(root_uri, step)}: step {step} was removed while it was being loaded (by another "
                    f"process's retention or gc); it is gone, not damaged{gone}",
                    step=step,
                    path=_where(root_uri, step),
                ) from exc
            step, attempt = newer, attempt + 1
            continue
        return step, result


def _where(root_uri: str, step: int) -> str:
    return f"{root_uri.rstrip('/')}/{step_dir(step)}"


def _kind(storage: Storage, step: int) -> str:
    """What the step's directory holds now (`format.classify`: "missing", "committed", "dcp"...)."""
    return classify(storage.child(step_dir(step)))


__all__ = ["RETRIES", "load_step"]
