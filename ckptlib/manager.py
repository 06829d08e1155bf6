"""CheckpointManager: one directory per step, one `latest` pointer, retention, autoresume.

The pointer is written once, by rank 0, only after the step committed, and read by all
ranks; never one pointer per rank (per-rank pointers went stale after a resize in
mosaicml/composer#2409).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Any, Mapping

from . import _dist
from .checkpoint import LoadResult, SaveResult, load, save
from .errors import CheckpointError, CheckpointNotFoundError, StateError
from .format import classify
from .storage import Storage, open_storage

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{10})$")


def step_dir(step: int) -> str:
    """Zero-padded so lexical order is step order."""
    return f"step_{step:010d}"


def parse_step(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class KeepLast:
    """Retention: keep the newest `n` committed steps (None keeps all)."""

    n: int | None = None

    def __post_init__(self):
        if self.n is not None and (not isinstance(self.n, int) or self.n < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {self.n!r}")

    def to_delete(self, committed: list[int], protected: set[int]) -> list[int]:
        if self.n is None:
            return []
        doomed = sorted(committed)[: max(0, len(committed) - self.n)]
        return [s for s in doomed if s not in protected]


class StalePointerWarning(UserWarning):
    """The `latest` pointer named a step that is missing or uncommitted."""


@dataclasses.dataclass
class StepInfo:
    step: int
    name: str
    state: str  # committed | incomplete


class CheckpointManager:
    """Saves numbered checkpoints under `root` and resumes from the newest committed one."""

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None, retention=None, process_group=None):
        self.root_uri = os.fspath(root)
        self.storage: Storage = open_storage(self.root_uri)
        self.retention = retention if retention is not None else KeepLast(keep_last)
        self.process_group = process_group

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root_uri!r})"

    # -- reading the root -------------------------------------------------------------
    def _scan(self) -> list[StepInfo]:
        out = []
        for name in self.storage.list_children():
            step = parse_step(name)
            if step is None:
                continue
            kind = classify(self.storage.child(name))
            out.append(StepInfo(step, name, "committed" if kind == "committed" else "incomplete"))
        return sorted(out, key=lambda s: s.step)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return [s.step for s in self._scan() if s.state == "committed"]

    def _resolve_latest(self) -> tuple[int | None, str | None]:
        """(step, warning) for the newest usable checkpoint: the pointer if it is valid."""
        target = self.storage.read_pointer(LATEST)
        committed = self.steps()
        if target is not None:
            step = parse_step(target)
            if step is not None and step in committed:
                return step, None
            fallback = committed[-1] if committed else None
            return fallback, (
                f"{self.root_uri}/{LATEST} points to {target!r}, which is not a committed checkpoint; "
                f"using step {fallback}" if fallback is not None else
                f"{self.root_uri}/{LATEST} points to {target!r}, which is not a committed checkpoint, "
                "and no committed step exists"
            )
        return (committed[-1] if committed else None), None

    def latest(self) -> int | None:
        """The step `load()` would resume from, or None when the root has no checkpoint."""
        step, warning = _dist.decide_on_rank0(self._resolve_latest, self.process_group)
        if warning:
            warnings.warn(warning, StalePointerWarning, stacklevel=2)
        return step

    def path(self, step: int) -> str:
        return f"{self.storage.uri.rstrip('/')}/{step_dir(step)}"

    # -- saving -------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], *, metadata: dict[str, Any] | None = None) -> SaveResult:
        """Save and commit `step`, move `latest` to it, then apply retention."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise StateError(f"step must be a non-negative int, got {step!r}")
        target = self.storage.child(step_dir(step))
        result = save(target, state, step=step, metadata=metadata, process_group=self.process_group)
        _dist.decide_on_rank0(lambda: self._publish(step), self.process_group)
        return result

    def _publish(self, step: int) -> None:
        self.storage.set_pointer(LATEST, step_dir(step))
        self._collect(protect={step})

    def _collect(self, protect: set[int], dry_run: bool = False) -> list[str]:
        """Retention and debris removal; never removes what `latest` names or `protect`."""
        scan = self._scan()
        pointed = parse_step(self.storage.read_pointer(LATEST) or "")
        protected = set(protect) | ({pointed} if pointed is not None else set())
        committed = [s.step for s in scan if s.state == "committed"]
        doomed = {s: step_dir(s) for s in self.retention.to_delete(committed, protected)}
        for info in scan:
            if info.state == "incomplete" and info.step not in protected:
                doomed[info.step] = info.name
        if not dry_run:
            for name in doomed.values():
                self.storage.delete_tree(name)
        return sorted(doomed.values())

    def gc(self, *, dry_run: bool = False) -> list[str]:
        """Apply retention and remove debris now; returns the step directories (to be) removed."""
        return _dist.decide_on_rank0(lambda: self._collect(protect=set(), dry_run=dry_run), self.process_group)

    # -- loading ------------------------------------------------------------------------
    def load(self, state: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> int | None:
        """Load `step` (None: the newest committed) into `state`; None when there is nothing to resume."""
        result = self.load_result(state, step, **kwargs)
        return None if result is None else result.step

    def load_result(self, state: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> LoadResult | None:
        if step is None:
            step = self.latest()
            if step is None:
                return None
        elif not isinstance(step, int) or isinstance(step, bool):
            raise StateError(f"step must be an int or None, got {step!r}")
        try:
            return load(self.storage.child(step_dir(step)), state, process_group=self.process_group, **kwargs)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.root_uri} has no step {step}", path=self.path(step)) from exc


__all__ = ["CheckpointManager", "KeepLast", "StalePointerWarning", "step_dir", "parse_step", "CheckpointError"]
