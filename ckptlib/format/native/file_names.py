"""File names of DCP's layout: which rank wrote a shard file, and which item sits at an offset
of one, for error messages and checks."""

from __future__ import annotations

import re

_SHARD_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def shard_rank(name: str) -> int | None:
    """The rank that wrote `__{rank}_{i}.distcp`, None for any other name."""
    match = _SHARD_RE.match(name)
    return int(match.group(1)) if match else None


def whose(name: str | None) -> str:
    """ " (rank 1's shard)" for a DCP shard file name, "" for any other name."""
    match = _SHARD_RE.match(name or "")
    return f" (rank {int(match.group(1))}'s shard)" if match else ""


def describe_file(name: str) -> str:
    """`name`, plus whose shard it is when it is a DCP shard file: '__1_0.distcp (rank 1's shard)'."""
    return f"{name}{whose(name)}"


def item_name(storage_data, name: str, offset: int) -> str:
    """The item of file `name` at `offset` as a user knows it, from `.metadata`'s storage_data:
    "tensor 'model.w'" (with its chunk's offsets when sharded), "object 'step'"; "item" when no
    record names it."""
    for index, info in (storage_data or {}).items():
        if getattr(info, "relative_path", None) == name and getattr(info, "offset", None) == offset:
            chunk = getattr(index, "offset", None)
            where = f" (chunk at {tuple(chunk)})" if chunk is not None and any(chunk) else ""
            kind = "tensor" if chunk is not None else "object"
            return f"{kind} {index.fqn!r}{where}"
    return "item"
