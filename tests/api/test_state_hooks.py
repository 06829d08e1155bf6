"""Modules whose state-dict hooks rename keys (torchtitan's fused QKV projection: the `wqkv`
parameter saved as `wq`/`wk`/`wv`, merged back on load), which torch's `get_model_state_dict`
cannot follow (AttributeError: no attribute 'wq'): saved and loaded through the module's own
`state_dict()`/`load_state_dict()`, resharded across world sizes with FSDP2 (DTensors stay
DTensors: the hooks' Replicate entries, the rest as shards), the optimizer (keyed by the fused
parameter's name) paired as usual. Every failure inside a user's module is a StateError
naming the state key, at every world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckptlib
from ckptlib._torch import parallel
from ckptlib.format import summarize

HEADS_Q, HEAD_DIM, DIM = 4, 3, 10  # wq: 12 rows, wk and wv: 3 rows each: wqkv (18, 10), uneven over 4 ranks


class FusedQKV(nn.Module):
    """The hook pattern of torchtitan's FusedQKVLinear, built by hand (no torchtitan here)."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(DIM, (HEADS_Q + 2) * HEAD_DIM, bias=True)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        for param in ("weight", "bias"):
            tensor = state_dict.pop(f"{prefix}wqkv.{param}")
            if isinstance(tensor, DTensor):  # as torchtitan does: gather, then split locally
                tensor = tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim)
            q, k, v = tensor.split([HEADS_Q * HEAD_DIM, HEAD_DIM, HEAD_DIM])
            for name, part in (("wq", q), ("wk", k), ("wv", v)):
                state_dict[f"{prefix}{name}.{param}"] = part.contiguous()

    @staticmethod
    def _merge(module, state_dict, prefix, *args) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        for param in ("weight", "bias"):
            keys = [f"{prefix}{name}.{param}" for name in ("wq", "wk", "wv")]
            if not all(key in state_dict for key in keys):
                continue
            parts = [state_dict.pop(key) for key in keys]
            if isinstance(parts[0], DTensor):
                parts = [p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim) for p in parts]
            state_dict[f"{prefix}wqkv.{param}"] = torch.cat(parts)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = FusedQKV()
        self.out = nn.Linear((HEADS_Q + 2) * HEAD_DIM, DIM)

    def forward(self, x):
        return self.out(self.attn.wqkv(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _build(seed: int, fsdp2: bool):
    torch.manual_seed(seed)
    model = Model()
    if fsdp2:
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = parallel.require_fsdp2_cpu()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, optim


def _train(model, optim, steps: int) -> None:
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        model(torch.randn(4, DIM, generator=gen)).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _full_state(model, optim) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, gathered (comparable across world sizes)."""
    from torch.distributed.tensor import DTensor

    def full(t):  # a copy: on one rank full_tensor() may be the local tensor itself
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"param.{name}": full(p) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in optim.state[p].items():
            out[f"optim.{name}.{key}"] = full(value)
    return out


def _save(uri: str, fsdp2: bool) -> dict:
    model, optim = _build(0, fsdp2)
    _train(model, optim, 2)
    ckptlib.save(uri, {"model": model, "optim": optim}, step=2)
    return _full_state(model, optim)


def _load(uri: str, fsdp2: bool) -> dict:
    model, optim = _build(1, fsdp2)
    _train(model, optim, 1)  # different values and optimizer state before the load
    ckptlib.load(uri, {"model": model, "optim": optim})
    loaded = _full_state(model, optim)
    _train(model, optim, 1)  # and it trains on
    return loaded


PAIRS = [(1, 2), (2, 3), (3, 1), (2, 2)]


@pytest.mark.parametrize("save_ws,load_ws", PAIRS, ids=[f"save{a}-fsdp2-load{b}-fsdp2-adamw" for a, b in PAIRS])
def test_renaming_hooks_save_and_reshard_bit_exact(tmp_path, dist_run, save_ws, load_ws):
    if parallel.fsdp2_cpu_reason() is not None:
        pytest.skip(parallel.fsdp2_cpu_reason())
    uri = str(tmp_path / "ckpt")
    saved = dist_run(save_ws, _save, uri, True)[0]
    tensors = {t["key"]: t for t in summarize(uri).tensors}
    assert "model.blocks.0.attn.wq.weight" in tensors and "model.blocks.0.attn.wqkv.weight" not in tensors
    assert tensors["model.blocks.1.attn.wk.bias"]["shape"] == [HEAD_DIM]
    # the optimizer is keyed by the fused parameter's name, paired with the same module
    assert "optim.state.blocks.0.attn.wqkv.weight.exp_avg" in tensors
    for loaded in dist_run(load_ws, _load, uri, True):
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key


def test_renaming_hooks_in_one_process_and_plain_dcp_reads_the_keys(tmp_path):
    import torch.distributed.checkpoint as dcp

    uri = str(tmp_path / "ckpt")
    saved = _save(uri, False)
    loaded = _load(uri, False)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    model, _ = _build(5, False)
    plain = {f"model.{k}": v for k, v in model.state_dict().items()}  # the hooks' names
    dcp.load(plain, checkpoint_id=uri)
    assert torch.equal(plain["model.blocks.0.attn.wq.weight"], saved["param.blocks.0.attn.wqkv.weight"][:12])


class _Raising(nn.Linear):
    pass


def _raise(*_args, **_kwargs):
    raise AttributeError("'_Raising' object has no attribute 'gone'")


def _state_with_a_failing_hook(where: str, failing_rank: int) -> dict:
    torch.manual_seed(0)
    module = _Raising(3, 3)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == failing_rank:
        if where == "state_dict":
            module.register_state_dict_pre_hook(_raise)
        else:
            module.register_load_state_dict_pre_hook(_raise)
    return {"extra": torch.zeros(2), "model": module}


def _outcome(action, uri: str, where: str, failing_rank: int) -> str:
    state = _state_with_a_failing_hook(where, failing_rank)
    try:
        if action == "save":
            ckptlib.save(uri, state)
        else:
            ckptlib.load(uri, state)
        return "ok"
    except ckptlib.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def _plain_save(uri: str) -> None:
    ckptlib.save(uri, {"extra": torch.zeros(2), "model": _Raising(3, 3)})


CASES = [("save", "state_dict"), ("load", "state_dict"), ("load", "load_state_dict")]


@pytest.mark.parametrize("action,where", CASES, ids=[f"{a}-{w}" for a, w in CASES])
def test_failure_inside_a_module_is_a_state_error_naming_the_key_in_one_process(tmp_path, action, where):
    uri = str(tmp_path / "ckpt")
    if action == "load":
        _plain_save(uri)
    outcome = _outcome(action, uri, where, 0)
    method = "load_state_dict" if where == "load_state_dict" else "state_dict"
    assert outcome == (
        f"StateError: state['model']: _Raising.{method}() raised AttributeError: '_Raising' object has no attribute "
        "'gone'"
    )


@pytest.mark.parametrize("action,where", CASES, ids=[f"{a}-{w}" for a, w in CASES])
@pytest.mark.parametrize("world", [2, 3])
def test_failure_inside_a_module_on_one_rank_is_a_state_error_on_every_rank(tmp_path, dist_run, action, where, world):
    uri = str(tmp_path / "ckpt")
    if action == "load":
        dist_run(world, _plain_save, uri)
    outcomes = dist_run(world, _outcome, action, uri, where, 1)
    method = "load_state_dict" if where == "load_state_dict" else "state_dict"
    expected = (
        f"StateError: rank 1: state['model']: _Raising.{method}() raised AttributeError: '_Raising' object has no "
        "attribute 'gone'"
    )
    assert outcomes == [expected] * world


def test_wrapped_module_keys_are_cleaned_as_torch_cleans_them(tmp_path):
    """torch.compile's `_orig_mod.` is not in the keys (as get_model_state_dict leaves it out),
    so a compiled model's checkpoint loads into a plain one and back."""
    uri = str(tmp_path / "ckpt")
    compiled = torch.compile(_build(0, False)[0], backend="eager")
    assert "_orig_mod.blocks.0.attn.wq.weight" in compiled.state_dict()
    ckptlib.save(uri, {"model": compiled})
    keys = {t["key"] for t in summarize(uri).tensors}
    assert "model.blocks.0.attn.wq.weight" in keys and not [k for k in keys if "_orig_mod" in k]
    plain = _build(1, False)[0]
    ckptlib.load(uri, {"model": plain})
    assert torch.equal(plain.blocks[0].attn.wqkv.weight, _build(0, False)[0].blocks[0].attn.wqkv.weight)
    again = torch.compile(_build(2, False)[0], backend="eager")
    ckptlib.load(uri, {"model": again})
    assert torch.equal(again.blocks[1].attn.wqkv.bias, _build(0, False)[0].blocks[1].attn.wqkv.bias)
