"""Transfer settings of the object-store backends: the shape of each backend's defaults table
(`Transfer`; the tables themselves sit beside each client: `s3.DEFAULTS`, `gcs.DEFAULTS`,
`azure.DEFAULTS`), their overrides from the environment (`CKPTLIB_<SCHEME>_<OPTION>`), and the
ranges a value must lie in."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckptlib.errors import StorageError

MiB = 1 << 20
GiB = 1 << 30

#: The settings a user may choose (constructor keywords and CKPTLIB_<SCHEME>_<OPTION>).
OPTIONS = ("multipart_threshold", "part_size", "max_concurrency", "read_chunk_size", "max_attempts")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One backend's defaults (the first five fields, `OPTIONS`) and the limits its service
    puts on them (None: no limit)."""

    multipart_threshold: int  # bytes a stream buffers before it becomes a multipart upload
    part_size: int  # bytes per part (parts grow beyond max_parts / 10 parts, see part_size_of)
    max_concurrency: int  # parts uploaded / chunks read at once, deletes in flight
    read_chunk_size: int  # a ranged read over twice this is split into parallel GETs of this size
    max_attempts: int  # tries per request, the first included (ObjectStorage.call's back-off between)
    min_part_size: int = 1
    max_part_size: int | None = None
    max_parts: int | None = None
    max_put_size: int | None = None  # the largest single-request upload; `write` streams parts beyond it

    def defaults(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in OPTIONS}

    def part_size_of(self, base: int, number: int) -> int:
        """The size of part `number` (1-based) of a stream whose first parts are `base` bytes: it
        doubles every max_parts / 10 parts, so a stream of unknown length fits the part limit
        (S3: 16 MiB parts cover 16 GiB, then 32 MiB parts, and so on), up to max_part_size."""
        size = base
        if self.max_parts:
            size = base << ((number - 1) // max(1, self.max_parts // 10))
        return min(size, self.max_part_size) if self.max_part_size else size

    def check(self, options: dict[str, Any]) -> None:
        """ValueError naming the first option outside its range."""
        for name in OPTIONS:
            value = options[name]
            low, high = {
                "part_size": (self.min_part_size, self.max_part_size),
                "multipart_threshold": (1, self.max_put_size),
            }.get(name, (1, None))
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < low or (high is not None and value > high):
                unit = " bytes" if name == "part_size" else ""
                allowed = f"within [{low}, {high}]{unit}" if high is not None else f">= {low}{unit}"
                raise ValueError(f"{name} must be {allowed}, got {value}")


def env_options(scheme: str) -> dict[str, int]:
    """The settings CKPTLIB_<SCHEME>_<OPTION> give (e.g. CKPTLIB_GS_PART_SIZE=8388608)."""
    out = {}
    for option in OPTIONS:
        name = f"CKPTLIB_{scheme.upper()}_{option.upper()}"
        raw = os.environ.get(name)
        if raw:
            try:
                out[option] = int(raw)
            except ValueError:
                raise StorageError(f"{name}={raw!r} is not an integer") from None
    return out
