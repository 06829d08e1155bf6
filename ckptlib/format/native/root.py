"""What a CheckpointManager root holds: its step directories, what each one is, and the step
the `latest` pointer names (falling back to the newest committed step when it is stale).

The pointer is written once, by rank 0, only after the step committed, and read by all
ranks; never one pointer per rank (per-rank pointers went stale after a resize in
mosaicml/composer#2409).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any, Callable

from ckptlib.errors import StateError
from ckptlib.format.native.layout import classify
from ckptlib.storage.base import Storage

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


LATEST = "latest"


class StalePointerWarning(UserWarning):
    """The `latest` pointer named a step that is missing or uncommitted."""


@dataclasses.dataclass
class StepInfo:
    step: int
    name: str
    state: str  # committed | incomplete | foreign
    files: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)


def scan(
    storage: Storage, *, parse: Callable[[str], int | None] = parse_step, dcp_state: str = "foreign"
) -> list[StepInfo]:
    """Every step directory of the root at `storage`, oldest first, with its files and state:
    "committed", "incomplete" (debris of a save or deletion that never finished), or
    "foreign" (files ckptlib did not write, or a plain DCP checkpoint someone put there:
    never debris, never deleted). `parse` names a step directory (another client's folders:
    `ckptlib.presets`), and `dcp_state` is what a complete plain DCP save is called."""
    out = []
    for name in storage.list_children():
        step = parse(name)
        if step is None:
            continue
        child = storage.child(name)
        files = child.list()
        kind = classify(child, files)
        state = {"committed": "committed", "other": "foreign", "dcp": dcp_state}.get(kind, "incomplete")
        out.append(StepInfo(step, name, state, files))
    return sorted(out, key=lambda s: s.step)


def committed_steps(storage: Storage) -> list[int]:
    """Committed steps, oldest first."""
    return [s.step for s in scan(storage) if s.state == "committed"]


def resolve_latest(storage: Storage, root_uri: str) -> tuple[int | None, str | None]:
    """(step, warning) for the newest usable checkpoint: the pointer's if it is committed,
    else the newest committed step with a warning that says why. A pointer that moved while
    the root was scanned (another process saved and its retention deleted the step it named)
    is read again with the root, a few times, rather than trusted stale."""
    for _ in range(3):
        target = storage.read_pointer(LATEST)
        committed = committed_steps(storage)
        if target is None or parse_step(target) in committed or storage.read_pointer(LATEST) == target:
            break
    if target is not None:
        step = parse_step(target)
        if step is not None and step in committed:
            return step, None
        fallback = committed[-1] if committed else None
        return fallback, (
            f"{root_uri}/{LATEST} points to {target!r}, which is not a committed checkpoint; using step {fallback}"
            if fallback is not None
            else f"{root_uri}/{LATEST} points to {target!r}, which is not a committed checkpoint, "
            "and no committed step exists"
        )
    return (committed[-1] if committed else None), None


def replace_reason(storage: Storage, root_uri: str, step: int) -> str | None:
    """Why a committed `step` that `latest` does not name may be overwritten, or None.

    It is a step the run never resumed from: committed just before a crash that came
    before the pointer moved, or left by a run that was rolled back to an older step.
    Refusing would leave the resumed run unable to save this step again. The step that
    `latest` names is never overwritten.
    """
    name = step_dir(step)
    if classify(storage.child(name)) != "committed":
        return None
    pointer = storage.read_pointer(LATEST)
    if pointer == name:
        return None
    return (
        f"{root_uri}/{name} is committed but {LATEST} names {pointer!r}: it was never resumed from "
        "(a crash before the pointer moved, or a rollback); replacing it"
    )


__all__ = ["LATEST", "StalePointerWarning", "StepInfo", "committed_steps", "replace_reason", "resolve_latest", "scan"]
