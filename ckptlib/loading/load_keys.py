"""Load control: which keys of the state a load fills, and under which checkpoint keys.

Keys are the flattened, dot-joined names DCP uses (`model.out.weight`,
`optim.state.out.weight.exp_avg`, as `ckpt inspect` lists them).

- `only=("model",)`: load just these top-level entries of the state; the others stay as
  they are (a model-only load from a full checkpoint, with the optimizer in the state).
- `ignore_keys=["model.head.*"]`: glob patterns (fnmatch, `*` also crosses dots) on the
  state's keys after renaming; matching keys are not loaded and keep their values, and an
  ignored key is never missing. A pattern that covers a whole entry (`optim.*`, or just
  `optim`) leaves that entry out entirely (an optimizer keeps even "no state yet").
- `rename={"old.": "new."}`: the checkpoint's key `old.x` loads into the state's key
  `new.x` (plain string prefixes, the longest matching prefix wins); or a callable that
  maps a checkpoint key to a state key. Two checkpoint keys renamed to the same state key
  are an error.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

from ckptlib._torch import dcp_shims
from ckptlib.errors import StateError, stacklevel_outside_ckptlib

Rename = Mapping[str, str] | Callable[[str], str]


def ignore_patterns(ignore_keys: Sequence[str] | str | None) -> list[str]:
    """`ignore_keys=` as a list of glob strings (StateError otherwise)."""
    patterns = [ignore_keys] if isinstance(ignore_keys, str) else list(ignore_keys or [])
    if not all(isinstance(p, str) for p in patterns):
        raise StateError(f"ignore_keys must be glob strings, got {ignore_keys!r}")
    return patterns


def _whole_entry_ignored(name: str, patterns: list[str]) -> bool:
    """A pattern that matches the entry's name, or every key under it (`optim.*`, `*`)."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name + ".\uffff", p) for p in patterns)


def select_entries(
    state: Mapping[str, Any], only: Sequence[str] | str | None, ignore_keys: Sequence[str] | str | None = None
) -> Mapping[str, Any]:
    """The top-level entries of `state` to load: those `only` names (all when None), less those
    `ignore_keys` ignores as a whole. Such entries are left out before any state dict is built:
    building an optimizer's initialises its state (DCP takes a zero-learning-rate step)."""
    if isinstance(only, str):
        only = (only,)
    if only is not None:
        unknown = [name for name in only if name not in state]
        if unknown:
            raise StateError(f"only= names {unknown} that the state does not have (it has {sorted(state)})")
    patterns = ignore_patterns(ignore_keys)
    if only is None and not any(_whole_entry_ignored(name, patterns) for name in state):
        return state
    return {
        name: value
        for name, value in state.items()
        if (only is None or name in only) and not _whole_entry_ignored(name, patterns)
    }


def _rename_fn(rename: Rename) -> Callable[[str], str]:
    if callable(rename):
        return rename
    if not isinstance(rename, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in rename.items()):
        raise StateError(f"rename must map old key prefixes to new ones (str -> str) or be a callable, got {rename!r}")
    prefixes = sorted(rename.items(), key=lambda kv: -len(kv[0]))

    def by_prefix(key: str) -> str:
        for old, new in prefixes:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    return by_prefix


@dataclasses.dataclass
class KeyRequest:
    """A flat request for DCP (checkpoint key -> value to load into) built from a nested
    template, and how to put what DCP replaced (non-tensor values) back into the template."""

    template: dict[str, Any]
    request: dict[str, Any]
    origin: dict[str, tuple]  # checkpoint key -> object path in the template
    ignored: list[str]
    unsourced: list[str]  # state keys no checkpoint key is renamed to (their own name was renamed away)

    def copy_back(self) -> None:
        flat_before = self._values
        for ckpt_key, path in self.origin.items():
            value = self.request[ckpt_key]
            if value is not flat_before[ckpt_key]:
                dcp_shims.set_element(self.template, path, value)

    def __post_init__(self):
        self._values = dict(self.request)


def build_request(
    template: dict[str, Any],
    saved_keys: Iterable[str],
    *,
    ignore_keys: Sequence[str] | None = None,
    rename: Rename | None = None,
) -> KeyRequest:
    """Flatten `template`, drop ignored keys and translate state keys to checkpoint keys."""
    saved_keys = list(saved_keys)
    patterns = ignore_patterns(ignore_keys)
    flat, mapping = dcp_shims.flatten_state_dict(template)
    to_ckpt: dict[str, str] = {}
    if rename is not None:
        fn = _rename_fn(rename)
        for ckpt_key in saved_keys:
            try:
                state_key = fn(ckpt_key)
            except Exception as exc:  # noqa: BLE001 - a user callable; reported with the key
                raise StateError(f"rename raised on checkpoint key {ckpt_key!r}: {exc!r}") from exc
            if not isinstance(state_key, str):
                raise StateError(f"rename returned {state_key!r} for checkpoint key {ckpt_key!r}; it must return a str")
            if state_key in to_ckpt:
                raise StateError(
                    f"rename maps both checkpoint keys {to_ckpt[state_key]!r} and {ckpt_key!r} to {state_key!r}"
                )
            to_ckpt[state_key] = ckpt_key
    request: dict[str, Any] = {}
    origin: dict[str, tuple] = {}
    ignored: list[str] = []
    unsourced: list[str] = []
    renamed_away = {ck for sk, ck in to_ckpt.items() if sk != ck}
    for key, value in flat.items():
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            ignored.append(key)
            continue
        ckpt_key = to_ckpt.get(key, key)
        if key not in to_ckpt and key in renamed_away:
            unsourced.append(key)
            continue
        if ckpt_key in request:
            raise StateError(f"state keys {key!r} and another both load from checkpoint key {ckpt_key!r}")
        request[ckpt_key] = value
        origin[ckpt_key] = mapping[key]
    _warn_unmatched(patterns, rename, [*flat, *saved_keys])
    return KeyRequest(
        template=template, request=request, origin=origin, ignored=sorted(ignored), unsourced=sorted(unsourced)
    )


class UnmatchedPatternWarning(UserWarning):
    """An `ignore_keys` pattern or a `rename` prefix that matches no key of the state or the
    checkpoint: most often a typo, and the load does what it would without it."""


def _warn_unmatched(patterns: Sequence[str], rename: Rename | None, keys: list[str]) -> None:
    """Warn of each ignore_keys pattern and rename prefix that matches nothing in `keys` (the
    state's flat keys and the checkpoint's; an entry's name counts as a key)."""
    names = set(keys) | {key.split(".", 1)[0] for key in keys}
    unmatched = [f"ignore_keys pattern {p!r}" for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if isinstance(rename, Mapping):
        unmatched += [f"rename prefix {old!r}" for old in rename if not any(k.startswith(old) for k in keys)]
    if unmatched:
        warnings.warn(
            f"{', '.join(unmatched)} matches no key of the state or the checkpoint (a typo?); it changes nothing",
            UnmatchedPatternWarning,
            stacklevel=stacklevel_outside_ckptlib(),
        )


__all__ = ["KeyRequest", "Rename", "UnmatchedPatternWarning", "build_request", "select_entries"]
