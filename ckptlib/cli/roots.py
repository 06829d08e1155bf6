"""Which checkpoint a command's argument names: the checkpoint itself, or a CheckpointManager
root's `latest` step (or its `--step N`), read through the manager's own code, resolved in one
place for every command that takes a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from typing import Any

from ckptlib.cli.usage import UsageError, int_at_least, open_uri

STEP_HELP = "when the path is a checkpoint root (a CheckpointManager's directory): read this step, not its latest"
SHOWN_STEPS = 10


#: `--step`'s value: a non-negative integer.
step_number = int_at_least(0, "a step number (an integer >= 0)")


def add_step(parser: argparse.ArgumentParser) -> None:
    """The `--step N` option of a command that takes a checkpoint."""
    parser.add_argument("--step", type=step_number, default=None, metavar="N", help=STEP_HELP)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The checkpoint a command reads; `root` and `step` are set when it is a root's step."""

    storage: Any
    root: str | None = None
    step: int | None = None
    chosen: str | None = None  # "latest" or "--step"
    warning: str | None = None  # why `latest` was not used as it stands (a stale pointer)

    @property
    def uri(self) -> str:
        return self.storage.uri

    def note(self) -> str | None:
        """The line a command prints first when it read a root's step (None: a checkpoint was named)."""
        if self.root is None:
            return None
        how = "its latest" if self.chosen == "latest" else "--step"
        line = f"checkpoint root {self.root}: using step {self.step} ({how}), {self.uri}"
        return line + (f"\nnote: {self.warning}" if self.warning else "")

    def to_json(self) -> dict[str, Any] | None:
        """{"uri", "step", "chosen", "warning"} of the root it came from, or None."""
        if self.root is None:
            return None
        return {"uri": self.root, "step": self.step, "chosen": self.chosen, "warning": self.warning}


def listed_steps(steps: list[int]) -> str:
    """Steps as a short list: all of them, or the first and last few and how many in all."""
    if len(steps) <= SHOWN_STEPS:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:3])) + ", ..., " + ", ".join(map(str, steps[-5:])) + f" ({len(steps)} in all)"


def _root_markers(storage) -> tuple[list[int], bool]:
    """(the step numbers of its step directories, whether it has a `latest` pointer): what
    makes a directory a checkpoint root; names only, no step directory is listed."""
    from ckptlib.errors import CheckpointError
    from ckptlib.format.native.root import LATEST, parse_step
    from ckptlib.storage.base import root_is_file

    try:
        if root_is_file(storage):
            return [], False
        names = [parse_step(name) for name in storage.list_children()]
        pointer = storage.read_pointer(LATEST)
    except (CheckpointError, OSError):  # unreadable: the command's own reading reports it
        return [], False
    return sorted(s for s in names if s is not None), pointer is not None


def resolve_checkpoint(uri: str, step: int | None = None) -> Resolved:
    """The checkpoint `uri` names: itself, or the step of the CheckpointManager root at `uri`
    that its `latest` pointer names (`step`: that step instead). Anything else is returned as
    is, and the command's own reading says what is there.

    Raises CheckpointNotFoundError naming the root (and its committed steps) for a root without
    committed steps or without `step`, and UsageError for `step` with a path that is no root."""
    from ckptlib.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError
    from ckptlib.format.native.root import step_dir
    from ckptlib.format.source import detect_format
    from ckptlib.manager.manager import CheckpointManager

    storage = open_uri(uri)
    try:
        detect_format(storage)
    except NotACheckpointError:
        present, pointer = _root_markers(storage)
    except CheckpointError:  # missing, incomplete, damaged: the command reports it
        present, pointer = [], False
    else:
        if step is not None:
            raise UsageError(f"--step {step}: {uri} is a checkpoint, not a checkpoint root of steps")
        return Resolved(storage)
    if not present and not pointer:
        if step is not None:
            raise UsageError(f"--step {step}: {uri} is not a checkpoint root (it has no step directories)")
        return Resolved(storage)
    manager = CheckpointManager(storage.uri)
    committed = manager.steps()
    if step is not None:
        if step not in committed:
            why = " (its step directory is incomplete)" if step in present else ""
            have = f"committed steps: {listed_steps(committed)}" if committed else "it has no committed step"
            raise CheckpointNotFoundError(f"{uri} has no committed step {step}{why}; {have}", path=uri)
        return Resolved(storage.child(step_dir(step)), uri, step, "--step")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = manager.latest()
    if latest is None:
        incomplete = f" (step directories that never committed: {listed_steps(present)})" if present else ""
        raise CheckpointNotFoundError(f"{uri} is a checkpoint root with no committed step{incomplete}", path=uri)
    warning = "; ".join(str(w.message) for w in caught) or None
    return Resolved(storage.child(step_dir(latest)), uri, latest, "latest", warning)


def resolve_arg(args: argparse.Namespace, uri: str) -> Resolved:
    """`resolve_checkpoint(uri, args.step)`, and which step of a root it read printed first
    (nothing for a checkpoint named directly; under --json the command's JSON says it)."""
    resolved = resolve_checkpoint(uri, getattr(args, "step", None))
    note = resolved.note()
    if note is not None and not getattr(args, "json", False):
        print(note)
    return resolved
