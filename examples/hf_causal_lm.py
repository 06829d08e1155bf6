"""A Hugging Face transformers causal LM described for `ckpt validate --spec`.

A tiny `LlamaForCausalLM` built from a config (no download), parallelized with the model's own
tensor-parallel plan (`model.tp_plan`: column-wise q/k/v/gate/up, row-wise o/down, a row-wise
embedding, a column-wise head that gathers its output) translated to torch's
`parallelize_module` styles, or sharded with FSDP2 per decoder layer. AdamW with a linear
warmup-then-cosine schedule (`transformers.get_cosine_schedule_with_warmup`) and the per-rank
RNG state. Every rank sees the same token batch (tensor parallelism needs it). Prove that it
resumes at any world size and layout:

    ckpt validate --spec examples/hf_causal_lm.py --world-sizes 1,2,3 --layouts fsdp2,tp

Needs `pip install transformers` (the `examples` extra pins the version the tests use). The
model has 6 attention heads and an MLP of 96, so every TP degree from 1 to 3 (and 6) splits
them evenly, and a vocabulary of 101 rows, which splits unevenly.
"""

from __future__ import annotations

import re

import torch

import ckptlib

LAYOUTS = ("fsdp2", "tp")
STEPS = 2
VOCAB, BATCH, SEQ = 101, 2, 8


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def build_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config())


def fsdp_units(model) -> list[torch.nn.Module]:
    return list(model.model.layers)


def _style(name: str):
    """A transformers TP style name as torch's parallel style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    if name not in styles:
        raise ValueError(f"TP style {name!r} of the model's tp_plan has no torch equivalent here")
    return styles[name]()


def tp_plan(model) -> dict:
    """The model's own TP plan (`model.tp_plan`, with `*` for the layer number), one entry per module."""
    modules = [name for name, _ in model.named_modules()]
    plan = {}
    for pattern, style in model.tp_plan.items():
        matcher = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        plan.update({name: _style(style) for name in modules if matcher.match(name)})
    return plan


def build_optimizers(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)


def build_schedulers(optimizers: dict):
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizers["optim"], num_warmup_steps=2, num_training_steps=20)


def build_state(rank: int, world_size: int) -> dict:
    return {"rng": ckptlib.RNGState()}


def batch(training, step: int) -> torch.Tensor:
    """The same tokens on every rank: a function of the step only."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss
