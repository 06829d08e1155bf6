"""The state dicts of a user's modules, optimizers and stateful objects, and every failure
inside them as a `StateError` naming the state key (and the rank, in a process group).

Modules go through torch's `get_model_state_dict`/`set_model_state_dict`, which key
everything by parameter FQN and so make a checkpoint independent of wrapping. Those helpers
cannot follow a module whose own state-dict hooks rename keys (torchtitan's fused QKV
projection saves its `wqkv` parameter as `wq`/`wk`/`wv` and merges them back on load: torch
raises AttributeError looking up `wq`). Such a module is detected, not named: when torch's
helper fails and the module's own `state_dict()` names keys that are none of its parameters
or buffers, its own `state_dict()`/`load_state_dict()` are used instead (their keys cleaned of
wrapper prefixes as torch's helper would). DTensors stay DTensors on that path, so sharded
entries are saved as shards and resharded on load like any other. Optimizers keep torch's
helpers: their state is keyed by parameter names, which such hooks do not change.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ckptlib._torch import module_keys
from ckptlib.errors import CheckpointError, StateError


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who calls into the user's objects: the rank (named in errors inside a process group)."""

    rank: int = 0
    distributed: bool = False

    def run(self, name: str, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`; anything it raises that is not a CheckpointError becomes a StateError naming
        `state[name]` and `what` was called (a hook raising, a state_dict() that fails)."""
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: named and re-raised
            raise self.error(name, what, exc) from exc

    def error(self, name: str, what: str, exc: BaseException) -> StateError:
        lead = f"rank {self.rank}: " if self.distributed else ""
        first = (str(exc).strip().splitlines() or [""])[0]
        return StateError(
            f"{lead}state[{name!r}]: {what} raised {type(exc).__name__}: {first}",
            rank=self.rank if self.distributed else None,
        )


@dataclasses.dataclass
class ModuleState:
    """A module's state dict for DCP and how to hand loaded values back (`own`: through the
    module's own load_state_dict, with `raw_keys` mapping cleaned keys to its own)."""

    state_dict: dict[str, Any]
    own: bool = False
    raw_keys: dict[str, str] = dataclasses.field(default_factory=dict)


def _renamed_keys(module: nn.Module, keys) -> list[str]:
    """Keys of `module.state_dict()` that name none of its parameters or buffers: hooks renamed them."""
    names = module_keys.parameter_and_buffer_names(module)
    return sorted(key for key in keys if key not in names)


# Modules found to rename keys: later calls skip torch's helper (which runs the module's hooks,
# collectives included, before it fails). Every rank finds the same, so every rank skips it.
_RENAMING: weakref.WeakSet = weakref.WeakSet()


def module_state(name: str, module: nn.Module, caller: Caller) -> ModuleState:
    """`module`'s state dict: torch's helper, or the module's own when its hooks rename keys."""
    helper_error: Exception | None = None
    if module not in _RENAMING:
        try:
            return ModuleState(get_model_state_dict(module))
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - decided below: renamed keys, or the user's failure
            helper_error = exc
    what = f"{type(module).__name__}.state_dict()"
    state_dict, raw_keys = caller.run(name, what, lambda: module_keys.own_state_dict(module))
    if _renamed_keys(module, raw_keys.values()):
        _RENAMING.add(module)
        return ModuleState(state_dict, own=True, raw_keys=raw_keys)
    _RENAMING.discard(module)
    if helper_error is None:  # its hooks were removed since: torch's helper again
        return module_state(name, module, caller)
    raise caller.error(name, "torch's get_model_state_dict", helper_error) from helper_error


def load_module_state(name: str, module: nn.Module, loaded: ModuleState, strict: bool, caller: Caller) -> None:
    """Hand the values DCP loaded into `loaded.state_dict` back to `module`."""
    what = f"{type(module).__name__}.load_state_dict()"
    if not loaded.own:  # torch's helper calls the module's load_state_dict (and its hooks)
        options = StateDictOptions(strict=strict)
        caller.run(name, what, lambda: set_model_state_dict(module, loaded.state_dict, options=options))
        return
    values = {loaded.raw_keys.get(key, key): value for key, value in loaded.state_dict.items()}
    caller.run(name, what, lambda: module.load_state_dict(values, strict=strict))


def optimizer_state(name: str, owner: nn.Module, optim: torch.optim.Optimizer, caller: Caller) -> dict[str, Any]:
    return caller.run(name, "torch's get_optimizer_state_dict", lambda: get_optimizer_state_dict(owner, optim))


def load_optimizer_state(
    name: str, owner: nn.Module, optim: torch.optim.Optimizer, loaded: dict[str, Any], strict: bool, caller: Caller
) -> None:
    options = StateDictOptions(strict=strict)
    caller.run(
        name,
        "torch's set_optimizer_state_dict",
        lambda: set_optimizer_state_dict(owner, optim, loaded, options=options),
    )


__all__ = ["Caller", "ModuleState", "load_module_state", "load_optimizer_state", "module_state", "optimizer_state"]
