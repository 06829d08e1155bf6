"""What every preset is: how one client lays out its checkpoints, so ckptlib reads them as is.

A preset is a small object with no state of its own. It knows

- the client's folders: how a checkpoint directory in its save folder is named
  (`step_of`), how new each is (`newness`: numbers, never names) and which one is the newest
  (`latest`), so `resolve` turns a save folder into
  the checkpoint to read and `ckpt ls` lists the folder;
- the client's keys: `rename(state)` maps a checkpoint key to the key of a ckptlib state
  (`{"model": module, "optim": optimizer}`, whatever the entries are called), and
  `model_name(key)` picks the model's tensors `export` writes by default;
- the plain-data objects its checkpoints hold (`safe_globals`: `datetime.timedelta`, numpy
  RNG state), allowed without `trusted=True`, and nothing more;
- its progress (`progress`): the step and the counters it saved (epoch, batch, ...), which
  a load reports in `LoadResult.step` and `LoadResult.metadata`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ckptlib.errors import NotACheckpointError, StateError
from ckptlib.format.native.root import StepInfo, scan
from ckptlib.format.source import detect_format, open_reader
from ckptlib.format.streaming import SourceValues
from ckptlib.storage.base import Storage

Rename = Callable[[str], str]


@dataclasses.dataclass(frozen=True)
class Entries:
    """The names a state gives its modules and optimizers (in the state's order), or the
    names ckptlib's docs use ("model", "optim") when it has none."""

    modules: tuple[str, ...]
    optimizers: tuple[str, ...]

    @classmethod
    def of(cls, state: Mapping[str, Any] | None) -> "Entries":
        state = state or {}
        modules = tuple(n for n, v in state.items() if isinstance(v, nn.Module))
        optimizers = tuple(n for n, v in state.items() if isinstance(v, torch.optim.Optimizer) or _is_flat(v))
        return cls(modules or ("model",), optimizers or ("optim",))

    @property
    def model(self) -> str:
        return self.modules[0]

    def optimizer(self, index: int) -> str:
        return self.optimizers[index] if index < len(self.optimizers) else f"{self.optimizers[0]}{index}"


def _is_flat(value: Any) -> bool:
    return getattr(value, "flat_optimizer_state", False) is True


def prefix_rename(prefixes: Mapping[str, str]) -> Rename:
    """A rename by prefix: the longest matching prefix wins; other keys stay as they are."""
    ordered = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))

    def rename(key: str) -> str:
        for old, new in ordered:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    return rename


def then(first: Rename, second: Mapping[str, str] | Rename | None) -> Rename:
    """`first`, then the user's own rename (a prefix mapping or a callable) on its result."""
    if second is None:
        return first
    if not callable(second):
        if not isinstance(second, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in second.items()
        ):
            raise StateError(
                f"rename must map old key prefixes to new ones (str -> str) or be a callable, got {second!r}"
            )
        second = prefix_rename(second)
    return lambda key: second(first(key))


class Preset:
    """The layout of one client's checkpoints (see the module docstring). Subclasses set the
    class attributes and override what differs."""

    name = ""
    client = ""  # the client it reads, with the version its layout was measured on
    folder_re: re.Pattern = re.compile(r"^$")  # a checkpoint folder's name; group "step" is its step

    def __repr__(self) -> str:
        return f"ckptlib.presets.{self.name}"

    # ------------------------------------------------------------------ folders

    def step_of(self, name: str) -> int | None:
        """The step of a checkpoint folder named `name`, or None when it is not one."""
        match = self.folder_re.match(name)
        return int(match.group("step")) if match else None

    def newness(self, info: StepInfo) -> tuple:
        """How new a checkpoint folder is, as numbers compared in order (bigger is newer; a
        tie falls back to the name): its step. A client whose names hold more (an epoch, a
        version counter) adds them."""
        return (info.step,)

    def scan(self, root: Storage) -> list[StepInfo]:
        """The checkpoint folders under a save folder, oldest first by `newness` ("dcp": a
        complete plain DCP save)."""
        return sorted(scan(root, parse=self.step_of, dcp_state="dcp"), key=lambda s: (self.newness(s), s.name))

    def latest(self, root: Storage) -> str | None:
        """The name of the newest complete checkpoint folder under `root`, or None."""
        done = [s for s in self.scan(root) if s.state in ("committed", "dcp")]
        return done[-1].name if done else None

    def checkpoint_name(self, storage: Storage) -> str | None:
        """The checkpoint to read at `storage`: None when it is one itself (or there is nothing
        to choose from: the load then reports what it found there), else the name of the
        newest checkpoint of the save folder it is (its `latest`)."""
        try:
            detect_format(storage)
            return None
        except NotACheckpointError:
            pass
        return self.latest(storage) if storage.exists() else None

    def resolve(self, storage: Storage) -> Storage:
        name = self.checkpoint_name(storage)
        return storage if name is None else storage.child(name)

    def looks_like_root(self, root: Storage) -> bool:
        """Whether `root` is this client's save folder (holds checkpoint folders it names)."""
        return any(self.step_of(name) is not None for name in root.list_children())

    # ------------------------------------------------------------------ keys and objects

    def rename(self, entries: Entries) -> Rename:
        """Checkpoint key -> the key of a ckptlib state with these entries."""
        return lambda key: key

    def model_name(self, key: str) -> str | None:
        """The model's own name (`model.state_dict()`'s) of a checkpoint key, or None when the
        key is not the model's."""
        return key[len("model.") :] if key.startswith("model.") else None

    def safe_globals(self) -> list:
        """Plain-data classes and functions its objects need to unpickle (weights_only)."""
        return []

    @contextlib.contextmanager
    def allowing(self) -> Iterator[None]:
        """`safe_globals()` allowed for weights_only unpickling inside the block."""
        allowed = self.safe_globals()
        if not allowed:
            yield
            return
        with torch.serialization.safe_globals(allowed):
            yield

    def adapt_state(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """The state to load into (a preset may wrap entries to match the client's layout)."""
        return state

    def progress(self, storage: Storage, *, trusted: bool) -> tuple[int | None, dict[str, Any]]:
        """(step, counters) the client saved with the checkpoint at `storage`."""
        return None, {}


def write_back(state: Mapping[str, Any], adapted: Mapping[str, Any]) -> None:
    """Plain values a load replaced in the adapted state go back to the caller's mapping."""
    if adapted is state:
        return
    for name, value in adapted.items():
        original = state.get(name)
        if value is not original and not _is_flat(value):
            state[name] = value  # type: ignore[index]


def read_objects(storage: Storage, wanted: Callable[[str], bool], *, trusted: bool) -> dict:
    """The non-tensor values of a checkpoint whose flat keys `wanted` selects, by flat key."""
    reader, info = open_reader(storage, verify=False, trusted=trusted)
    values = SourceValues(reader, info.metadata, trusted=trusted)
    values.object_keys = [k for k in values.object_keys if wanted(k)]
    return values.objects()


__all__ = ["Entries", "Preset", "prefix_rename", "read_objects", "then", "write_back"]
