"""The checks of a load that each rank computes on its own: the keys and shapes the state asks
for against the checkpoint's, the dtype conversions a load would make, and the size a load
reports, and the checkpoint keys a request leaves unused (`UnusedKeys`, the ballot that
gathers them). `ckptlib.loading.loading` agrees on their outcome in one round."""

from __future__ import annotations

import difflib
import fnmatch
import math
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptlib._torch import dcp_shims
from ckptlib.errors import DtypeMismatchError, MissingKeysError, ShapeMismatchError, StateError
from ckptlib.format.items.tensor_kinds import unsupported_tensor
from ckptlib.format.native.aliases import satisfied_by_alias
from ckptlib.format.native.layout import CheckpointInfo


def _is_lossless(saved: torch.dtype, requested: torch.dtype) -> bool:
    """Every value of `saved` is exactly representable in `requested` (a widening: fp16->fp32,
    int32->int64, bool->int8); float<->int and narrowing conversions are lossy."""
    if saved.is_complex != requested.is_complex or saved.is_floating_point != requested.is_floating_point:
        return saved == torch.bool and not requested.is_complex
    return torch.promote_types(saved, requested) == requested


def describe_casts(casts: dict[str, tuple[torch.dtype, torch.dtype]]) -> str:
    shown = [
        f"{key} saved as {str(saved).replace('torch.', '')}, requested {str(requested).replace('torch.', '')}"
        f"{'' if _is_lossless(saved, requested) else ' (lossy)'}"
        for key, (saved, requested) in list(casts.items())[:20]
    ]
    return "; ".join(shown) + (f" ... ({len(casts)} in all)" if len(casts) > 20 else "")


def check_request(
    template: dict[str, Any],
    info: CheckpointInfo,
    strict: bool,
    keep_if_absent: frozenset[str] = frozenset(),
    cast: bool = False,
) -> tuple[list[str], list[str], dict[str, tuple[torch.dtype, torch.dtype]], dict[str, str], set[str]]:
    """Compare the requested keys with the checkpoint; return the missing ones, the absent ones
    the state keeps its own value for (`LoadTarget.keep_if_absent`), the dtype conversions
    the load will make ({key: (saved, requested)}, only with `cast`), the absent ones an
    alias fills ({key: the saved key whose value is the same memory}: a tied weight), and the
    checkpoint keys the request reads."""
    saved = info.metadata.state_dict_metadata
    flat = dcp_shims.flatten_state_dict(template)[0]
    refused = {key: reason for key, reason in ((k, unsupported_tensor(v)) for k, v in flat.items()) if reason}
    if refused:
        raise StateError(
            f"{info.uri}: the state cannot be loaded into: "
            + "; ".join(f"{key} is {reason}" for key, reason in list(refused.items())[:20]),
            path=info.uri,
        )
    missing = sorted(k for k in flat if k not in saved)
    if missing:  # a checkpoint from torch <= 2.3 keys nested plain values differently
        old_flat = dcp_shims.flatten_state_dict_pre_2_4(template)[0]
        old_missing = sorted(k for k in old_flat if k not in saved)
        if len(old_missing) < len(missing):
            flat, missing = old_flat, old_missing
    # Kept only where the checkpoint holds the same param group (an optimizer it lacks stays missing).
    groups = {k.rsplit(".", 1)[0] for k in saved}
    kept = [k for k in missing if k in keep_if_absent and k.rsplit(".", 1)[0] in groups]
    missing = [k for k in missing if k not in keep_if_absent]
    aliased = satisfied_by_alias(missing, flat, saved)  # loading the saved name fills the other
    missing = [k for k in missing if k not in aliased]
    if missing and strict:
        unused = sorted(k for k in saved if k not in flat)
        shapes = {k: tuple(v.shape) for k, v in flat.items() if k in set(missing) and isinstance(v, torch.Tensor)}
        raise MissingKeysError(
            f"{info.uri} lacks keys the state asks for: {_listed(missing)}"
            f"{missing_keys_hint(missing, template, saved, unused, shapes)}",
            keys=missing,
            unused=unused,
            path=info.uri,
        )
    problems = []
    bad_keys = []
    casts: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for key, value in flat.items():
        meta = saved.get(key)
        if meta is None:
            continue
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                problems.append(f"{key}: a tensor in the state, a non-tensor object in the checkpoint")
            elif tuple(value.shape) != tuple(meta.size):
                problems.append(f"{key}: shape {tuple(value.shape)} in the state, {tuple(meta.size)} in the checkpoint")
            else:
                if value.dtype != meta.properties.dtype:
                    casts[key] = (meta.properties.dtype, value.dtype)
                continue
            bad_keys.append(key)
        elif isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key}: a {type(value).__name__} in the state, a tensor in the checkpoint")
            bad_keys.append(key)
    if problems:
        problems += [
            f"{key}: dtype {requested} in the state, {saved} in the checkpoint"
            for key, (saved, requested) in casts.items()
        ]
        raise ShapeMismatchError(
            f"{info.uri}: state does not match the checkpoint: " + "; ".join(problems[:20]),
            keys=bad_keys + list(casts),
            path=info.uri,
        )
    if casts and not cast:
        raise DtypeMismatchError(
            f"{info.uri}: dtypes differ from the checkpoint ({describe_casts(casts)}); pass cast=True to convert them",
            keys=list(casts),
            casts=casts,
            path=info.uri,
        )
    return missing, kept, casts, aliased, {k for k in flat if k in saved} | set(aliased.values())


def unused_candidates(
    saved: Iterable[str], used: set[str], left_out: Sequence[str], only, patterns: Sequence[str]
) -> set[str]:
    """The checkpoint keys this rank's request leaves unused, less those under top-level
    entries left out on purpose (`left_out`: the state's entries it does not load, per-rank
    state; with `only=`, every entry it does not name) and those `ignore_keys` names."""
    saved = list(saved)
    excluded = list(left_out)
    if only is not None:  # a partial load: the checkpoint's other entries are left out on purpose
        chosen = (only,) if isinstance(only, str) else tuple(only)
        excluded += sorted({key.split(".", 1)[0] for key in saved} - set(chosen))

    def skipped(key: str) -> bool:
        return any(key == name or key.startswith(name + ".") for name in excluded) or any(
            fnmatch.fnmatchcase(key, p) for p in patterns
        )

    return {key for key in saved if key not in used and not skipped(key)}


class UnusedKeys:
    """A Ballot of the load's agreement round: every rank votes 1 for each checkpoint key it
    reads or leaves out on purpose; after the MAX reduction, the keys no rank voted for are
    the load's unused keys (`found`)."""

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.votes = [1] * len(self.keys)  # what a rank whose checks failed votes
        self.found: list[str] = []

    def mark(self, unused: set[str]) -> None:
        self.votes = [0 if key in unused else 1 for key in self.keys]

    def counted(self, reduced: list[int]) -> None:
        self.found = [key for key, vote in zip(self.keys, reduced) if not vote]


def describe_unused(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:20]) + (f" ... ({len(keys)} in all)" if len(keys) > 20 else "")
    return f"{len(keys)} checkpoint key{'s' if len(keys) != 1 else ''} the state does not ask for: {shown}"


def checkpoint_size(info: CheckpointInfo) -> int | None:
    """A checkpoint's size: its files per the manifest, else the bytes of its tensors."""
    if info.manifest is not None:
        return info.manifest.total_bytes
    total = 0
    for md in info.metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            total += math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()
    return total


__all__ = [
    "UnusedKeys",
    "check_request",
    "checkpoint_size",
    "describe_casts",
    "describe_unused",
    "unused_candidates",
]


def _entry_keys(entry: str, keys) -> list[str]:
    return [k for k in keys if k == entry or k.startswith(entry + ".")]


def _listed(keys: list[str], limit: int = 20) -> str:
    return ", ".join(keys[:limit]) + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")


def missing_keys_hint(
    missing: list[str], template: Any, saved, unused: list[str] = (), shapes: dict[str, tuple] | None = None
) -> str:
    """What to do about `missing`: wrap a flat state dict under the entry the checkpoint keeps
    its keys in; `rename=` when the checkpoint holds the same keys under another prefix (a
    renamed layer), with the checkpoint's `unused` keys listed; the checkpoint's top-level
    entries a mistyped entry of the state resembles ("did you mean"); or `only=` /
    `strict=False` when whole entries of the state (a module, an optimizer, a dict) are absent
    from a checkpoint that holds the others (a model-only checkpoint loaded into a full state).
    `shapes`: the missing tensors' shapes (a rename only pairs tensors of the same shape)."""
    if not hasattr(template, "keys"):
        return ""
    wrap = _wrap_hint(missing, template, saved)
    if wrap:
        return wrap
    saved_shapes = {k: tuple(m.size) for k, m in saved.items() if isinstance(m, TensorStorageMetadata)}
    renamed = _rename_hint(missing, unused, lambda m, u: (shapes or {}).get(m) == saved_shapes.get(u))
    return (
        renamed
        + _entry_hint(missing, template, saved)
        + (
            f"; the checkpoint's keys the state does not ask for: {_listed(list(unused))}"
            if unused and not renamed
            else ""
        )
    )


def _wrap_hint(missing: list[str], template: Any, saved) -> str:
    """A flat state dict (`model.state_dict()`: tensors at the top) whose keys the checkpoint
    keeps under one entry ("model.weight"): say to pass {entry: model}."""
    if not all(isinstance(template[k], torch.Tensor) for k in template.keys()):
        return ""
    entries = {k.split(".", 1)[0] for k in saved if "." in k and k.split(".", 1)[1] in set(missing)}
    found = [e for e in sorted(entries) if all(f"{e}.{k}" in saved for k in missing)]
    if not found:
        return ""
    entry = found[0]
    return (
        f"; the state is a flat state dict (tensors at its top level) and the checkpoint keeps these keys under "
        f"{entry!r} ({entry}.{missing[0]}, ...): pass {{{entry!r}: model}} (the module, or its state_dict) as the "
        "state"
    )


def _rename_hint(missing: list[str], unused: list[str], same_shape: Callable[[str, str], bool]) -> str:
    """The prefix rename (checkpoint prefix -> state prefix, as `rename=` takes it) that turns
    the most unused checkpoint keys into missing state keys of the same shape, when one does
    without turning any other unused key into a key the state lacks."""
    lacking, spare = set(missing), list(unused)
    candidates: dict[tuple[str, str], int] = {}
    for m in missing:
        for u in spare:
            mp, up = m.split("."), u.split(".")
            n = 0
            while n < min(len(mp), len(up)) - 1 and mp[-1 - n] == up[-1 - n]:
                n += 1
            if n == 0:
                continue
            pair = (".".join(up[:-n]) + ".", ".".join(mp[:-n]) + ".")
            candidates[pair] = candidates.get(pair, 0) + 1
    best = None
    for (old, new), _ in sorted(candidates.items(), key=lambda kv: (-kv[1], kv[0])):
        moved = [u for u in spare if u.startswith(old)]
        if moved and all(new + u[len(old) :] in lacking and same_shape(new + u[len(old) :], u) for u in moved):
            best = (old, new, moved)
            break
    if best is None or (best[0].count(".") == 1 and best[1].count(".") == 1):
        return ""  # a whole top-level entry: `_entry_hint`'s "did you mean" says it better
    old, new, moved = best
    return (
        f"; the checkpoint has {_listed(moved, 5)} that the state does not ask for: if the layer was renamed, load "
        f"with rename={{{old!r}: {new!r}}}"
    )


def _entry_hint(missing: list[str], template: Any, saved) -> str:
    lacking = set(missing)
    entries = [e for e in template.keys() if isinstance(e, str) and not isinstance(template[e], torch.Tensor)]
    absent = [e for e in entries if not _entry_keys(e, saved) and _entry_keys(e, lacking)]
    if not absent:
        return ""
    saved_tops = sorted({k.split(".", 1)[0] for k in saved})
    others = [t for t in saved_tops if t not in template]
    hints, unmatched = [], []
    for entry in absent:
        close = difflib.get_close_matches(entry, others, n=1, cutoff=0.6)
        if close:
            hints.append(f"the state's {entry!r} is not in the checkpoint, which has {close[0]!r}: did you mean it?")
        else:
            unmatched.append(entry)
    present = [e for e in template.keys() if isinstance(e, str) and _entry_keys(e, saved)]
    if unmatched and present:
        hints.append(
            f"the checkpoint has no {', '.join(repr(e) for e in unmatched)} at all (it holds "
            f"{', '.join(repr(t) for t in saved_tops[:10])}): load only={tuple(present)!r} to load the rest, "
            "or strict=False to skip what it lacks"
        )
    return "".join(f"; {hint}" for hint in hints)
