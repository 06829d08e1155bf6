"""A manager's `initial_load`: the checkpoint a run starts from while its root has no step."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .errors import CheckpointNotFoundError, StateError
from .loading import LoadResult, load


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


__all__ = ["load_initial"]
