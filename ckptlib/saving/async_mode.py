"""How an async save writes: the options object of `ckptlib.async_save` and `CheckpointManager(async_save=)`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ckptlib.errors import StateError
from ckptlib.saving import writer_process


@dataclasses.dataclass(frozen=True)
class AsyncMode:
    """An async save: `writer="process"` writes the shards in a long-lived writer process per
    rank, from shared memory (no GIL contention with the training loop; falls back to a thread,
    with a RuntimeWarning, where no memfd exists), `"thread"` in a background thread of this
    process, `"auto"` (the default) "process" where memfd exists (Linux) and "thread" elsewhere,
    silently: the writer `ckpt bench async` measured faster (docs/benchmarks.md).
    `background_staging=True`: the save returns before the staging copy, which then runs first
    in the background (see `ckptlib.async_save`). `max_staging_bytes=N`: a save never holds more
    than N bytes of staging copies; it copies and writes its tensors in pieces of at most N
    (`ckptlib.saving.capped_staging`), so it is staged later, once its last piece is copied."""

    writer: str = "auto"
    background_staging: bool = False
    max_staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.writer not in writer_process.WRITERS:
            raise StateError(f"async_mode must be 'auto', 'thread' or 'process', got {self.writer!r}")
        if not isinstance(self.background_staging, bool):
            raise StateError(f"AsyncMode background_staging must be a bool, got {self.background_staging!r}")
        cap = self.max_staging_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise StateError(f"AsyncMode max_staging_bytes must be a positive int (bytes) or None, got {cap!r}")

    @classmethod
    def of(cls, value: Any) -> "AsyncMode | None":
        """`async_save=` as given: False or None (saves block), True (the default mode), an AsyncMode."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        raise StateError(f"async_save must be a bool or an AsyncMode, got {type(value).__name__} {value!r}")

    def writer_here(self) -> str:
        """The writer this machine runs: `writer`, or "thread" where a process cannot work
        ("auto" silently, "process" with a RuntimeWarning)."""
        return writer_process.check_mode(self.writer)

    def start_writer(self):
        """This rank's writer process, started now (it imports torch while the caller sets up),
        or None for a thread writer."""
        return writer_process.writer() if self.writer_here() == "process" else None


__all__ = ["AsyncMode"]
