"""Turning a user's `state` mapping into DCP state dicts and back.

`state` maps names to modules (plain, DDP, FSDP2), optimizers (paired with the module
that owns their parameters), objects with `state_dict()`/`load_state_dict()`, tensors or
DTensors, nested dicts of tensors and plain values, and `RankLocal` per-rank state.
Modules and optimizers go through `torch.distributed.checkpoint.state_dict`, which keys
everything by parameter FQN, so a checkpoint is independent of wrapping and world size (a
module whose state-dict hooks rename keys through its own methods: `ckptlib.state.module_state`).
Top-level names may contain '.' (`model.state_dict()` itself is a valid state: its flat
dotted keys are what `dcp.save(model.state_dict())` writes); every failure inside the user's
objects is a StateError naming the state key.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
import warnings
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch
from torch import nn

from ckptlib._torch import dcp_shims, probes
from ckptlib.errors import StateError, stacklevel_outside_ckptlib
from ckptlib.state.module_state import Caller, load_module_state, load_optimizer_state, module_state, optimizer_state
from ckptlib.state.state_checks import check_flat_keys, check_picklable


class ResizeWarning(UserWarning):
    """Per-rank state could not be restored one-to-one because the world size changed."""


class ResizePolicy(Protocol):
    """Which saved rank's per-rank state a rank restores when the world size changed."""

    def source_rank(self, rank: int, saved_world_size: int, world_size: int) -> int | None:
        """A saved rank to restore from, or None to start this rank's state fresh."""


class MergingResizePolicy(ResizePolicy, Protocol):
    """A resize policy that builds each rank's state from *every* saved rank's state
    (e.g. `ckptlib.MergeSamplerProgress` for data-loader positions)."""

    def merge(self, states: list[Any], rank: int, world_size: int) -> Any:
        """This rank's state, given the saved ranks' states in rank order."""


@dataclasses.dataclass(frozen=True)
class KeepExistingRanks:
    """Ranks that existed at save time restore their own state; new ranks start fresh.

    For `RNGState`, "fresh" means seeded deterministically from (step, rank), so a resumed
    run is reproducible. Ranks that no longer exist are dropped (with a warning).
    """

    def source_rank(self, rank: int, saved_world_size: int, world_size: int) -> int | None:
        return rank if rank < saved_world_size else None


def derived_seed(step: int | None, rank: int) -> int:
    """A deterministic 63-bit seed for a rank that has no saved RNG state."""
    digest = hashlib.sha256(f"ckptlib-rng:{step if step is not None else -1}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RankLocal:
    """Per-rank state (a dataloader position, an RNG): saved under one key per rank.

    Same world size on load: every rank gets back exactly its own state. Different
    world size: `policy` decides (default `KeepExistingRanks`), and a ResizeWarning says so.
    """

    def __init__(self, obj: Any, *, policy: ResizePolicy | None = None):
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise StateError(f"RankLocal needs an object with state_dict()/load_state_dict(), got {type(obj).__name__}")
        self.obj = obj
        self.policy = policy or KeepExistingRanks()

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.obj.load_state_dict(sd)

    def start_fresh(self, step: int | None, rank: int) -> None:
        """Called on a rank that has no saved state to restore; the wrapped object keeps its own."""


class _RNGs:
    """python, numpy and torch (and this rank's CUDA device) generator states."""

    def state_dict(self) -> dict[str, Any]:
        _, key, pos, has_gauss, gauss = np.random.get_state()
        sd: dict[str, Any] = {
            "python": random.getstate(),
            "numpy_key": torch.from_numpy(key.astype(np.int64)),
            "numpy_pos": int(pos),
            "numpy_has_gauss": int(has_gauss),
            "numpy_gauss": float(gauss),
            "torch": torch.get_rng_state(),
        }
        if probes.cuda_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        random.setstate(_as_python_state(sd["python"]))
        key = sd["numpy_key"].numpy().astype(np.uint32)
        np.random.set_state(
            ("MT19937", key, int(sd["numpy_pos"]), int(sd["numpy_has_gauss"]), float(sd["numpy_gauss"]))
        )
        torch.set_rng_state(sd["torch"])
        if "cuda" in sd and probes.cuda_available():
            torch.cuda.set_rng_state(sd["cuda"])


def _as_python_state(value: Any) -> tuple:
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


class RNGState(RankLocal):
    """Per-rank RNG state of python `random`, numpy and torch; reseeded on new ranks."""

    def __init__(self, *, policy: ResizePolicy | None = None):
        super().__init__(_RNGs(), policy=policy)

    def start_fresh(self, step: int | None, rank: int) -> None:
        seed = derived_seed(step, rank)
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _check_tree(value: Any, path: str) -> None:
    """Nested dicts may hold tensors, plain values and more dicts, not modules or optimizers.

    Nested keys may contain '.' (raw model state dicts do); DCP joins the path with '.' and
    rejects a resulting duplicate key.
    """
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise StateError(f"state key {path}.{k!r} must be a string, got {type(k).__name__}")
            _check_tree(v, f"{path}.{k}")
    elif isinstance(value, (nn.Module, torch.optim.Optimizer, RankLocal)):
        raise StateError(
            f"state[{path!r}] is a {type(value).__name__} inside a nested dict; put modules, optimizers "
            "and RankLocal objects at the top level of the state mapping"
        )


def _modules(state: Mapping[str, Any]) -> dict[str, nn.Module]:
    return {name: value for name, value in state.items() if isinstance(value, nn.Module)}


def _owner_module(name: str, optim: torch.optim.Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    """The module in `state` whose parameters include all of this optimizer's parameters."""
    wanted = {id(p) for group in optim.param_groups for p in group["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise StateError(
        f"optimizer state[{name!r}] has parameters that belong to no nn.Module in the state; "
        f"put the model it optimizes in the same state mapping (modules found: {sorted(modules) or 'none'})"
    )


def _validate(state: Any) -> None:
    if not isinstance(state, Mapping):
        raise StateError(f"state must be a mapping of names to objects, got {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise StateError(f"state key {name!r} must be a non-empty string")
        if isinstance(value, Mapping):
            _check_tree(value, name)


Agree = Callable[[Callable[[], Any]], Any]


class CollectiveSteps:
    """Runs a state's steps so that a failure on one rank never leaves the others inside torch's
    collectives (a module's or optimizer's state dict, get or set, may run some: FSDP1's do).
    A step's error is held; before a step that may run collectives, and at `finish`, the ranks
    agree (`agree`: `_dist.agree`) on whether any step since the last agreement failed, and if
    one did every rank raises. `agreed` steps are agreed right away (their results decide the
    steps that follow). Every rank must take the same steps. Without `agree` (one process)
    every step just runs."""

    def __init__(self, agree: Agree | None = None):
        self._agree = agree
        self._error: Exception | None = None
        self._unagreed = False

    def local(self, fn: Callable[[], Any]) -> Any:
        """Run `fn`, holding its error (then None) when ranks must agree first."""
        if self._agree is None:
            return fn()
        self._unagreed = True
        if self._error is None:
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - raised on every rank at the next agreement
                self._error = exc
        return None

    def collective(self, fn: Callable[[], Any]) -> Any:
        self.finish()  # nobody enters torch's collectives while a step failed somewhere
        return self.local(fn)

    def agreed(self, fn: Callable[[], Any]) -> Any:
        if self._agree is None:
            return fn()
        self.finish()
        return self._agree(fn)

    def finish(self) -> None:
        if self._agree is not None and self._unagreed:
            self._unagreed = False
            self._agree(self._raise_held)

    def _raise_held(self) -> None:
        if self._error is not None:
            raise self._error


def _checked(state: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], dict[str, nn.Module]]:
    _validate(state)
    return list(state.items()), _modules(state)


def to_save_state_dict(state: Mapping[str, Any], *, rank: int, agree: Agree | None = None) -> dict[str, Any]:
    """The DCP state dict to save for `state` on this rank (`agree`: see CollectiveSteps)."""
    steps = CollectiveSteps(agree)
    caller = Caller(rank, agree is not None)
    items, modules = steps.agreed(lambda: _checked(state))  # every rank then takes the same steps
    out: dict[str, Any] = {}
    for name, value in items:
        if isinstance(value, nn.Module):
            out[name] = steps.collective(lambda n=name, v=value: module_state(n, v, caller).state_dict)
        elif isinstance(value, torch.optim.Optimizer):
            out[name] = steps.collective(
                lambda n=name, v=value: optimizer_state(n, _owner_module(n, v, modules), v, caller)
            )
        elif isinstance(value, RankLocal):
            out[name] = steps.local(
                lambda n=name, v=value: {_rank_key(rank): caller.run(n, _what(v, "state_dict"), v.state_dict)}
            )
        elif _is_stateful(value):
            out[name] = steps.local(lambda n=name, v=value: caller.run(n, _what(v, "state_dict"), v.state_dict))
        else:
            out[name] = value
    steps.local(lambda: check_flat_keys(state, out))
    steps.local(lambda: check_picklable(out, ""))
    steps.finish()
    return out


def _what(obj: Any, method: str) -> str:
    """How errors name a call into the user's object: `Counter.state_dict()`."""
    inner = obj.obj if isinstance(obj, RankLocal) else obj
    return f"{type(inner).__name__}.{method}()"


@dataclasses.dataclass
class LoadTarget:
    """What DCP loads into (`template`) and how to hand the loaded values back."""

    template: dict[str, Any]
    appliers: list[tuple[Callable[[], None], bool]]  # (hand back, may run collectives: see CollectiveSteps)
    notes: list[str]
    # Flat keys the checkpoint may lack; the state keeps its own value for them: optimizer
    # hyperparameters a newer torch added (Adam's `decoupled_weight_decay` is absent from a
    # checkpoint an older torch wrote, and its default is what the older torch did).
    keep_if_absent: frozenset[str] = frozenset()


def to_load_target(
    state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    saved_world_size: int | None,
    step: int | None,
    strict: bool,
    agree: Agree | None = None,
) -> LoadTarget:
    """Build the template DCP loads into, and the callbacks that apply it to `state`
    (`agree`: see CollectiveSteps; `apply_all` runs the callbacks)."""
    steps = CollectiveSteps(agree)
    caller = Caller(rank, agree is not None)
    items, modules = steps.agreed(lambda: _checked(state))  # every rank then takes the same steps
    template: dict[str, Any] = {}
    appliers: list[tuple[Callable[[], None], bool]] = []
    notes: list[str] = []

    for name, value in items:
        if isinstance(value, nn.Module):
            module = steps.collective(lambda n=name, v=value: module_state(n, v, caller))
            template[name] = module.state_dict if module is not None else None
            appliers.append(
                (
                    lambda m=value, n=name, ms=module: load_module_state(
                        n, m, dataclasses.replace(ms, state_dict=template[n]), strict, caller
                    ),
                    True,
                )
            )
        elif isinstance(value, torch.optim.Optimizer):
            owner = steps.local(lambda n=name, v=value: _owner_module(n, v, modules))
            template[name] = steps.collective(lambda n=name, o=owner, v=value: optimizer_state(n, o, v, caller))
            appliers.append(
                (lambda o=value, m=owner, n=name: load_optimizer_state(n, m, o, template[n], strict, caller), True)
            )
        elif isinstance(value, RankLocal):
            entry = steps.local(
                lambda n=name, v=value: _rank_local_entry(
                    n,
                    v,
                    rank=rank,
                    world_size=world_size,
                    saved_world_size=saved_world_size,
                    step=step,
                    template=template,
                    caller=caller,
                )
            )
            if entry is not None:
                applier, note = entry
                appliers.append((applier, False))
                notes += [note] if note else []
        elif _is_stateful(value):
            template[name] = steps.local(lambda n=name, v=value: caller.run(n, _what(v, "state_dict"), v.state_dict))
            appliers.append(
                (
                    lambda v=value, n=name: caller.run(
                        n, _what(v, "load_state_dict"), lambda: v.load_state_dict(template[n])
                    ),
                    False,
                )
            )
        elif isinstance(value, Mapping):
            template[name] = value  # loaded in place: tensors copied into, plain values replaced
            # DCP may replace a whole sub-dict (pre-2.4 checkpoints keyed a dict of plain
            # values as one item); copy such replacements back into the caller's dicts.
            appliers.append((lambda v=value, n=name: _merge_back(v, template[n]), False))
        elif isinstance(value, torch.Tensor):
            template[name] = value
        else:
            template[name] = value
            appliers.append((lambda n=name: _set_plain(state, n, template[n]), False))
    steps.finish()
    # After the last collective step: the caller's one agreement on the load's checks
    # (`loading._prepare_request`) raises it on every rank, with no round of its own.
    check_flat_keys(state, template)
    for note in notes:
        warnings.warn(note, ResizeWarning, stacklevel=stacklevel_outside_ckptlib())
    optimizers = {name for name, value in items if isinstance(value, torch.optim.Optimizer)}
    return LoadTarget(
        template=template, appliers=appliers, notes=notes, keep_if_absent=_hyperparameter_keys(template, optimizers)
    )


def _rank_local_entry(
    name: str,
    value: RankLocal,
    *,
    rank: int,
    world_size: int,
    saved_world_size: int | None,
    step: int | None,
    template: dict[str, Any],
    caller: Caller,
) -> tuple[Callable[[], None], str | None]:
    """A RankLocal's template (put into `template`), its applier and its resize note."""
    saved = saved_world_size if saved_world_size is not None else world_size
    merge = getattr(value.policy, "merge", None)

    def current() -> Any:
        return caller.run(name, _what(value, "state_dict"), value.state_dict)

    def restore(sd: Any) -> None:
        caller.run(name, _what(value, "load_state_dict"), lambda: value.load_state_dict(sd))

    if saved != world_size and callable(merge):
        # One copy per saved rank: a state_dict() may hand out the same object twice.
        template[name] = {_rank_key(r): copy.deepcopy(current()) for r in range(saved)}
        note = (
            f"state[{name!r}]: saved by {saved} rank{'s' if saved != 1 else ''}, loading on {world_size}; "
            f"rank {rank} merges "
            f"every saved rank's per-rank state ({type(value.policy).__name__})"
        )
        return (lambda: restore(merge([template[name][_rank_key(r)] for r in range(saved)], rank, world_size))), note
    source = rank if saved == world_size else value.policy.source_rank(rank, saved, world_size)
    note = None
    if saved != world_size:
        what = f"restores saved rank {source}'s" if source is not None else "starts fresh"
        note = (
            f"state[{name!r}]: saved by {saved} rank{'s' if saved != 1 else ''}, loading on {world_size}; "
            f"rank {rank} {what} "
            f"per-rank state ({type(value.policy).__name__})"
        )
    if source is None:
        return (lambda: value.start_fresh(step, rank)), note
    key = _rank_key(source)
    template[name] = {key: current()}
    return (lambda: restore(template[name][key])), note


def apply_all(target: LoadTarget, steps: CollectiveSteps) -> None:
    """Run `target`'s appliers as `steps`, collective ones (modules, optimizers) as such."""
    for applier, collective in target.appliers:
        (steps.collective if collective else steps.local)(applier)


def _hyperparameter_keys(template: dict[str, Any], optimizers: set[str]) -> frozenset[str]:
    """Flat keys of the optimizers' param-group hyperparameters (not their `params` lists)."""
    if not optimizers:
        return frozenset()
    _, paths = dcp_shims.flatten_state_dict({name: template[name] for name in optimizers})
    return frozenset(
        key for key, path in paths.items() if len(path) == 4 and path[1] == "param_groups" and path[3] != "params"
    )


def _merge_back(dst: Any, src: Any) -> None:
    if dst is src or not isinstance(src, Mapping):
        return
    for key, loaded in src.items():
        current = dst.get(key) if isinstance(dst, Mapping) else None
        if current is loaded:
            continue
        if isinstance(current, Mapping) and isinstance(loaded, Mapping):
            _merge_back(current, loaded)
        elif isinstance(current, torch.Tensor) and isinstance(loaded, torch.Tensor) and current.shape == loaded.shape:
            current.copy_(loaded)
        else:
            dst[key] = loaded


def _set_plain(state: Mapping[str, Any], name: str, value: Any) -> None:
    if not isinstance(state, dict) and not hasattr(state, "__setitem__"):
        raise StateError(f"cannot store loaded value for {name!r}: the state mapping is read-only")
    state[name] = value  # type: ignore[index]
