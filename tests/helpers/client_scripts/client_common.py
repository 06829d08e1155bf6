"""What the client scripts share (they run in the client envs, not in pytest): the result
report the test reads, full (unsharded) state for bit-exact comparisons, rank helpers."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def report(**values) -> None:
    """Write this process's result for the test (tests/helpers/client_envs.run reads it)."""
    with open(os.path.join(os.environ["CKPTLIB_RESULT_DIR"], f"rank{rank()}.json"), "w") as f:
        json.dump(values, f, indent=1, sort_keys=True, default=str)


def full(value):
    """A copy of a DTensor's full tensor (a collective) or of a plain tensor, on CPU: never a
    view of live state that training goes on changing."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def full_state(model, optimizer=None) -> dict:
    """{"model": {fqn: tensor}, "optim": {"state": {fqn: {slot: tensor}}, "lr": [...]}}, unsharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {"model": {k: full(v) for k, v in get_model_state_dict(model).items()}}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer)
        out["optim"] = {
            "state": {fqn: {slot: full(v) for slot, v in slots.items()} for fqn, slots in osd["state"].items()},
            "lr": [group["lr"] for group in osd["param_groups"]],
        }
    return out


def differences(expected, actual, path: str = "") -> list[str]:
    """Every leaf where `actual` differs from `expected` (tensors bit-exactly, dtype included)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or sorted(map(str, expected)) != sorted(map(str, actual)):
            extra = sorted(set(map(str, actual)) ^ set(map(str, expected))) if isinstance(actual, dict) else "type"
            return [f"{path or '.'}: keys differ ({extra})"]
        out = []
        for key in expected:
            out += differences(expected[key], actual[key], f"{path}.{key}" if path else str(key))
        return out
    if isinstance(expected, torch.Tensor):
        same = isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype and torch.equal(expected, actual)
        return [] if same else [f"{path}: differs"]
    return [] if expected == actual else [f"{path}: {expected!r} != {actual!r}"]


def init_gloo() -> None:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")


def finish() -> None:
    if dist.is_initialized():
        import ckptlib

        ckptlib.exit_barrier()
        dist.destroy_process_group()
