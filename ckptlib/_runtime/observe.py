"""One INFO line per checkpoint operation on `logging.getLogger("ckptlib")`.

Every save, load, export and gc logs, on rank 0 only, what it moved and how fast:

    save step=200 bytes=1073741824 seconds=2.104 MiB/s=486.7 world_size=4 uri=/ckpt/step_0000000200
    save step=300 ... world_size=4 async blocked_seconds=0.081 uri=...   (seconds = total)

The same figures ride on the record as `record.ckptlib` (a dict), so log processors and
tests read them without parsing the text.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptlib._scrub import logger as scrubbed_logger

logger = scrubbed_logger("ckptlib")  # its records are scrubbed of credentials, as every storage module's

MIB = 1 << 20


def mib_per_s(nbytes: int | None, seconds: float | None) -> float | None:
    if nbytes is None or not seconds or seconds <= 0:
        return None
    return nbytes / MIB / seconds


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if value < 1000 else f"{value:.1f}"
    return str(value)


def log_operation(
    op: str,
    *,
    uri: str,
    step: int | None,
    nbytes: int | None,
    seconds: float,
    world_size: int | None,
    blocked_seconds: float | None = None,
    rank: int = 0,
    **extra: Any,
) -> None:
    """Log `op` (save, load, export, gc) on rank 0: step, bytes, seconds, MiB/s, world size,
    and for async saves the seconds the caller was blocked (`seconds` is then the total)."""
    if rank != 0 or not logger.isEnabledFor(logging.INFO):
        return
    fields: dict[str, Any] = {
        "op": op,
        "step": step,
        "bytes": nbytes,
        "seconds": seconds,
        "mib_per_s": mib_per_s(nbytes, seconds),
        "world_size": world_size,
    }
    if blocked_seconds is not None:
        fields["async"] = True
        fields["blocked_seconds"] = blocked_seconds
    fields.update(extra)
    fields["uri"] = uri
    text = " ".join(
        f"{'MiB/s' if k == 'mib_per_s' else k}={_fmt(v)}" for k, v in fields.items() if k not in ("op", "async")
    )
    if blocked_seconds is not None:
        text = text.replace(" blocked_seconds=", " async blocked_seconds=", 1)
    logger.info("%s %s", op, text, extra={"ckptlib": fields})


__all__ = ["log_operation", "logger", "mib_per_s"]
