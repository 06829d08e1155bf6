"""A small transformer for the layout matrix: every parameter kind a real model shards.

Embedding, attention projections, a gated MLP, LayerNorm and RMSNorm, an output head tied
to the embedding, and a 3-output value head. Dims shard unevenly (vocab 37, model dim 30,
MLP output rows 30 at 4 ranks) and the value head has fewer rows than the FSDP degree at
4 ranks, so some ranks hold zero-size shards. Attention heads (12) divide
every TP degree from 1 to 4, as real TP requires (row-wise inputs must split evenly),
and so does the MLP hidden dim (48).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, HEAD_DIM, FFN, VALUES = 37, 30, 12, 3, 48, 3
BATCH, SEQ = 4, 6
INNER = HEADS * HEAD_DIM


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, INNER, bias=False)
        self.wk = nn.Linear(DIM, INNER, bias=False)
        self.wv = nn.Linear(DIM, INNER, bias=False)
        self.wo = nn.Linear(INNER, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them.
        q, k, v = (proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.value = nn.Linear(DIM, VALUES, bias=False)  # 3 rows: a zero-size shard at degree 4
        self.head.weight = self.embed.weight
        self.register_buffer("pos", torch.zeros(SEQ, DIM))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x), self.value(x)

    # What the layout builders need to know about this model.
    def fsdp_units(self) -> list[nn.Module]:
        """Submodules that get their own FSDP unit (the root gets one too)."""
        return list(self.blocks)

    def tp_plan(self) -> dict[str, Any]:
        """parallelize_module plan: column-wise in, row-wise out, a vocab-sharded embedding."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict[str, Any] = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
            # Row-wise: as a column-wise layer its 3 rows leave a zero-size shard at TP 4, and
            # torch 2.13's DTensor cannot propagate AdamW's lerp_ over that shard's gradient
            # ("in-place operations that require placement changes are not supported").
            # FSDP still gives it zero-size shards; its 30 input columns split 8/8/8/6 here.
            "value": RowwiseParallel(input_layouts=Replicate()),
        }
        for i in range(len(self.blocks)):
            for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
                plan[f"blocks.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.wo", "mlp.w2"):
                plan[f"blocks.{i}.{name}"] = RowwiseParallel()
        return plan

    def retie(self) -> None:
        """Tie the head to the embedding again (parallelizing replaces parameters)."""
        self.head.weight = self.embed.weight


def build_transformer(seed: int) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer()
    with torch.no_grad():
        model.pos.copy_(torch.randn(SEQ, DIM) * 0.1)
    return model


def token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next tokens): the same on every rank and at every world size."""
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def transformer_loss(model: nn.Module, step: int) -> torch.Tensor:
    tokens, targets = token_batch(step)
    logits, value = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + value.square().mean()
