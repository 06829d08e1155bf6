"""File names of DCP's layout: which rank wrote a shard file, for error messages and checks."""

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
