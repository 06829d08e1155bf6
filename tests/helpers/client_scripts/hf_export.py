"""transformers `from_pretrained` of a ckptlib export equals the trained model (issue 28.6).

    hf_export.py WORKDIR TIED(tied|untied) DTYPE(bfloat16|float32) SHARDS(sharded|single) ORDER(config-first|hf-config)

Trains a tiny Llama a few steps, saves it with ckptlib, exports it (config-first: the user
saved config.json into the target before exporting; hf-config: the export copies the
model's config in), loads it back with AutoModelForCausalLM.from_pretrained and compares.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from client_common import differences, report
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import ckptlib
from ckptlib.cli import main as ckpt


def main() -> None:
    workdir, tied, dtype_name, shards, order = sys.argv[1:6]
    dtype = getattr(torch, dtype_name)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied == "tied",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optim.step()
        optim.zero_grad()
    ckpt_dir, out = os.path.join(workdir, "ckpt"), os.path.join(workdir, "hf")
    ckptlib.save(ckpt_dir, {"model": model, "optim": optim}, step=3)
    if order == "config-first":
        model.config.save_pretrained(out)  # the natural order: config, then weights
        hf_config = None
    else:
        hf_config = model.config
    result = ckptlib.export(
        ckpt_dir, out, model_only=True, hf_config=hf_config, max_shard_size="40KB" if shards == "sharded" else "5GB"
    )
    loaded = AutoModelForCausalLM.from_pretrained(out)
    index_path = os.path.join(out, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    names = set(index["weight_map"]) if index else None
    record = json.load(open(os.path.join(out, "ckptlib_export.json")))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    actual = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    report(
        differences=differences(expected, actual),
        loaded_dtype=str(loaded.dtype),
        tied_in_model=loaded.lm_head.weight is loaded.model.embed_tokens.weight,
        tied=result.tied,
        files=sorted(os.listdir(out)),
        index_metadata=index["metadata"] if index else None,
        index_has_lm_head=None if names is None else "lm_head.weight" in names,
        num_parameters=loaded.num_parameters(),
        expected_total_size=sum(v.numel() * v.element_size() for k, v in expected.items() if k not in result.tied),
        record=record,
        verify_rc=ckpt(["verify", out]),
        inspect_rc=ckpt(["inspect", out]),
    )


if __name__ == "__main__":
    main()
