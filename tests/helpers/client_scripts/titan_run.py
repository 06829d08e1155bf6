"""torchtitan 0.3.0 and ckptlib, both ways (issue 28.3, 28.5, 28.6). Under torchrun:

    titan_run.py save ROOT MANAGER     a tiny llama3 (fused QKV, FSDP2 when ws > 1), its OptimizersContainer, LR
                                       schedulers, dataloader and train state take 2 steps; MANAGER (torchtitan:
                                       its own CheckpointManager; ckptlib: ckptlib.integrations.torchtitan's) saves
                                       step-2 into ROOT/MANAGER/checkpoint. Rank 0 writes the full state to
                                       ROOT/expected.pt.
    titan_run.py resume ROOT MANAGER SAVED   a fresh build loads step-2 through MANAGER (from SAVED's folder)
    titan_run.py preset ROOT SAVED           ckptlib.load(ROOT/SAVED/checkpoint, ..., preset="torchtitan")

torchtitan cannot train on CPU (flex attention), so the steps use synthetic gradients.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from client_common import differences, finish, full, init_gloo, rank, report, world
from torch.utils.data import IterableDataset

import ckptlib

warnings.filterwarnings("ignore")


def tiny_llama3():
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model

    dim, heads, kv_heads, vocab = 64, 4, 2, 128
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=heads,
            n_kv_heads=kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


class Tokens(IterableDataset):
    def __iter__(self):
        for i in range(1000):
            yield torch.full((8,), i, dtype=torch.long)


class TrainState:
    """What torchtitan's Trainer saves under 'train_state'."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build():
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    model = tiny_llama3()
    if world() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world(),))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim_config = default_adamw(lr=1e-2)
    optim_config.implementation = "for-loop"
    optimizers = optim_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    loader = ParallelAwareDataloader(Tokens(), dp_rank=rank(), dp_world_size=world(), batch_size=2)
    return model, optimizers, schedulers, loader


def steps(model, optimizers, schedulers, loader, state, n):
    from torch.distributed.tensor import distribute_tensor

    batches = iter(loader)
    for s in range(n):
        batch = next(batches)
        g = torch.Generator().manual_seed(100 + s)
        for p in model.parameters():
            grad = torch.randn(p.shape, generator=g)
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else grad
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step += 1
        state.ntokens_seen += batch.numel()


def snapshot(model, optimizers) -> dict:
    """The model's state_dict and the optimizer's flat tensors and learning rates, unsharded."""
    flat = optimizers.state_dict()
    return {
        "model": {k: full(v).clone() for k, v in model.state_dict().items()},
        "optim": {k: full(v).clone() for k, v in flat.items() if k.startswith("state.")},
        "lr": {k: v for k, v in flat.items() if k.startswith("param_groups.") and k.endswith(".lr")},
    }


def manager(kind: str, folder_root: str, model, optimizers, schedulers, loader, state, **config):
    if kind == "ckptlib":
        from ckptlib.integrations.torchtitan import CheckpointManager
    else:
        from torchtitan.components.checkpoint import CheckpointManager
    cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0, **config)
    return CheckpointManager(
        cfg,
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=folder_root,
    )


def main() -> None:
    mode, root = sys.argv[1], os.path.abspath(sys.argv[2])
    init_gloo()
    model, optimizers, schedulers, loader = build()
    state = TrainState()
    expected_path = os.path.join(root, "expected.pt")
    if mode == "save":
        kind = sys.argv[3]
        steps(model, optimizers, schedulers, loader, state, 2)
        mgr = manager(kind, os.path.join(root, kind), model, optimizers, schedulers, loader, state)
        mgr.save(curr_step=2)
        mgr.close()
        expected = snapshot(model, optimizers)
        if rank() == 0:
            torch.save(expected, expected_path)
        folder = os.path.join(root, kind, "checkpoint", "step-2")
        report(files=sorted(os.listdir(folder)) if rank() == 0 else [], world=world())
    elif mode == "resume":
        kind, saved = sys.argv[3], sys.argv[4]
        mgr = manager(
            kind,
            os.path.join(root, saved),
            model,
            optimizers,
            schedulers,
            loader,
            state,
            exclude_from_loading=["dataloader"],
        )
        loaded = mgr.load(step=2)
        mgr.close()
        got = snapshot(model, optimizers)
        report(
            loaded=loaded,
            differences=differences(torch.load(expected_path, weights_only=True), got),
            train_state=state.state_dict(),
            world=world(),
        )
    else:
        saved = sys.argv[3]
        optim = optimizers.optimizers[0]
        result = ckptlib.load(
            os.path.join(root, saved, "checkpoint"), {"model": model, "optim": optim}, preset="torchtitan"
        )
        got = snapshot(model, optimizers)
        report(
            differences=differences(torch.load(expected_path, weights_only=True), got),
            step=result.step,
            metadata=result.metadata,
            uri=os.path.basename(result.uri),
            world=world(),
        )
    finish()


if __name__ == "__main__":
    main()
