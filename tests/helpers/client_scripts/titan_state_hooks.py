"""torchtitan 0.3's real Llama3 with its fused QKV projection (`wqkv` saved as `wq`/`wk`/`wv`
by state-dict hooks, which torch's get_model_state_dict cannot follow), saved and loaded by
ckptlib with its AdamW (torchtitan's default_adamw), at any world size (FSDP2 over more than one
rank). torchtitan cannot train on CPU (flex attention): steps use synthetic gradients.

    titan_state_hooks.py CKPT save|load     (one process, or under torchrun)

Reports: the checkpoint's model keys, whether torch's helper fails on this model, and every
parameter and optimizer tensor, unsharded (for the test's bit-exact comparison).
"""

from __future__ import annotations

import sys

import torch
from client_common import finish, init_gloo, rank, report, world

import ckptlib


def tiny_llama3(seed: int):
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model

    dim, n_heads, n_kv_heads, vocab = 64, 4, 2, 128
    cfg = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


def build(seed: int):
    from torchtitan.components.optimizer.optimizer import default_adamw

    model = tiny_llama3(seed)
    if world() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world(),))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"
    optimizers = config.build(model_parts=[model])
    return model, optimizers


def steps(model, optimizers, seed: int, n: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for step in range(n):
        gen = torch.Generator().manual_seed(seed + step)
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=gen)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad
        optimizers.step()
        optimizers.zero_grad()


def unsharded(model, optim) -> dict:
    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    out = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"optim.{n}.{k}": full(v) for k, v in optim.state[p].items()})
    return out


def main(uri: str, action: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    init_gloo()
    model, optimizers = build(0 if action == "save" else 1)
    steps(model, optimizers, 100 if action == "save" else 200, 2 if action == "save" else 1)
    optim = optimizers.optimizers[0]
    try:
        get_model_state_dict(model)
        helper = "ok"
    except Exception as exc:  # noqa: BLE001 - what torch says about this model
        helper = f"{type(exc).__name__}: {exc}"
    state = {"model": model, "optim": optim}
    if action == "save":
        ckptlib.save(uri, state, step=2)
    else:
        ckptlib.load(uri, state)
    values = unsharded(model, optim)
    keys = sorted(t["key"] for t in ckptlib.format.summarize(uri).tensors)
    path = f"{uri}.{action}.ws{world()}.rank{rank()}.pt"
    torch.save(values, path)
    report(helper=helper, keys=keys, values=path)
    finish()


if __name__ == "__main__":
    main(*sys.argv[1:3])
