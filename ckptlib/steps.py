"""Step numbers and the names of their directories: any step of int64 round-trips.

Steps below 10^10 keep the historical ten-digit zero padding (`step_0000000042`), so roots
written before stay readable and lexical order is step order there; larger steps are
written with as many digits as they need (`step_12345678901`), up to int64's 19. Callers
sort by the parsed number, never by name. A name that is not exactly what `step_dir` writes
for its number (`step_00000000042`, `step_42`) is not a step directory: ckptlib neither
lists nor deletes it.
"""

from __future__ import annotations

import operator
import re
from typing import Any

from .errors import StateError

INT64_MAX = (1 << 63) - 1
_PAD = 10
_STEP_RE = re.compile(r"^step_(\d{10,19})$")
# What a local directory deletion leaves when it crashes between its rename and the removal.
DELETING_RE = re.compile(r"^step_\d{10,19}\.deleting-[0-9a-f]{8}$")


def check_step(step: Any, what: str = "step") -> int:
    """`step` as an int if it is a non-negative integer within int64, else StateError.

    bool, float (even 3.0), str and numbers past int64 are refused: a step names a directory
    and is compared numerically, so a lossy conversion could hide or overwrite a checkpoint.
    """
    if isinstance(step, bool) or isinstance(step, (float, str, bytes)):
        raise StateError(f"{what} must be a non-negative int, got {type(step).__name__} {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise StateError(f"{what} must be a non-negative int, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise StateError(f"{what} must be a non-negative int, got {value}")
    if value > INT64_MAX:
        raise StateError(f"{what} {value} does not fit in int64 (at most {INT64_MAX})")
    return value


def step_dir(step: int) -> str:
    """The directory name of `step` (ten digits at least, zero-padded)."""
    return f"step_{check_step(step):0{_PAD}d}"


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory."""
    match = _STEP_RE.match(name or "")
    if match is None:
        return None
    value = int(match.group(1))
    if value > INT64_MAX or f"step_{value:0{_PAD}d}" != name:
        return None
    return value


__all__ = ["DELETING_RE", "INT64_MAX", "check_step", "parse_step", "step_dir"]
