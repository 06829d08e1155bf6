"""The key names a module's own `state_dict()` gives its entries, as torch's state-dict helpers
(`get_model_state_dict`) would name them: without the segments torch's wrappers add.

`torch.compile` adds `_orig_mod.`, activation checkpointing `_checkpoint_wrapped_module.`,
FSDP1 `_fsdp_wrapped_module.`, DDP a leading `module.`; `get_model_state_dict` removes them, so
a checkpoint does not depend on how the model was wrapped. ckptlib's fallback for modules whose
state-dict hooks rename keys (`ckptlib.state.module_state`) uses the module's own `state_dict()` and
cleans its keys the same way.
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Module attribute names of torch's wrappers, as they appear inside state-dict keys.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _is_ddp(module: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


def clean_key(module: nn.Module, key: str) -> str:
    """`key` of `module.state_dict()` without the wrappers' segments."""
    parts = [part for part in key.split(".") if part not in _WRAPPER_SEGMENTS]
    if _is_ddp(module) and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def parameter_and_buffer_names(module: nn.Module) -> set[str]:
    """Every name `module.state_dict()` uses when no hook renames anything: parameters and
    buffers (tied ones under each of their names) and modules' `_extra_state` entries."""
    names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            names.add(f"{prefix}._extra_state" if prefix else "_extra_state")
    return names


def own_state_dict(module: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """`module.state_dict()` (its hooks run once), keyed as `get_model_state_dict` keys (see
    `clean_key`), and {clean key: the module's own key} for handing values back."""
    raw = module.state_dict()
    keys = {clean_key(module, key): key for key in raw}
    return {clean: raw[key] for clean, key in keys.items()}, keys
