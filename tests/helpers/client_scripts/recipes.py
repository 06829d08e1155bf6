"""Runs one docs/migrating.md recipe ("Coming from ...") against the real package (tests/clients/test_recipes.py):

    recipes.py CLIENT RECIPE.py WORKDIR    (CLIENT: torchtitan, huggingface, composer, lightning)

A prelude builds what the recipe names (a model, an optimizer, a trainer, the client's own
checkpoint to read), the recipe's code runs as written, and an epilogue checks what it did.
"""

from __future__ import annotations

import functools
import os
import sys
import types

import torch
from client_common import differences, finish, full_state, init_gloo, report

import ckptlib


def torchtitan(code: str) -> None:
    import titan_run

    init_gloo()
    model, optimizers, schedulers, loader = titan_run.build()
    state = titan_run.TrainState()
    titan_run.steps(model, optimizers, schedulers, loader, state, 2)
    own = titan_run.manager("torchtitan", "outputs", model, optimizers, schedulers, loader, state)
    own.save(curr_step=2)  # torchtitan's own checkpoint, for the recipe's load
    own.close()
    expected = titan_run.snapshot(model, optimizers)
    model, optimizers, schedulers, loader = titan_run.build()
    ns = {
        "ckptlib": ckptlib,
        "config": types.SimpleNamespace(checkpoint=None),
        "model": model,
        "optimizers": optimizers,
    }
    exec(code, ns)
    got = titan_run.snapshot(model, optimizers)
    manager = ns["config"].checkpoint.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder="ours",
    )
    manager.save(curr_step=500)  # the recipe's interval
    manager.close()
    report(
        differences=differences(expected, got),
        manager=f"{type(manager).__module__}.{type(manager).__name__}",
        committed=os.path.isfile("ours/checkpoint/step-500/ckptlib.json"),
    )
    finish()


def huggingface(code: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optim.step()
    expected = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    ns = {"ckptlib": ckptlib, "model": model, "optim": optim, "AutoModelForCausalLM": AutoModelForCausalLM}
    exec(code, ns)
    loaded = {k: v.detach() for k, v in ns["model"].state_dict().items()}
    report(differences=differences(expected, loaded), files=sorted(os.listdir("hf")))


def composer(code: str) -> None:
    import composer_run
    from composer_run import Plain

    from ckptlib.presets import composer_save

    trainer = composer_run.trainer("runs/tiny", 2)  # Composer's own checkpoint, for the recipe's load
    trainer.fit()
    expected = full_state(trainer.state.model, trainer.state.optimizers[0])
    model = Plain()
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    ns = {"ckptlib": ckptlib, "composer_save": composer_save, "model": model, "optim": optim, "trainer": trainer}
    exec(code, ns)
    report(
        differences=differences(expected, full_state(model, optim)),
        step=ns["result"].step,
        pointer=os.readlink("runs/tiny-ckptlib/latest-rank0.pt"),
        committed=os.path.isfile("runs/tiny-ckptlib/ep0-ba2/ckptlib.json"),
    )
    trainer.close()


def lightning(code: str) -> None:
    import lightning as real
    import lightning_run
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    quick = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    first = real.Trainer(  # Lightning's own strategy writes the checkpoint the recipe reads
        strategy=ModelParallelStrategy(),
        max_steps=4,
        callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True)],
        **quick,
    )
    first.fit(lightning_run.Tiny(), lightning_run.data())
    expected = full_state(first.lightning_module, first.optimizers[0])
    net = lightning_run.Holder()
    optim = torch.optim.AdamW(net.parameters(), lr=1.0)
    bounded = types.SimpleNamespace(Trainer=functools.partial(real.Trainer, max_steps=6, **quick))
    ns = {"ckptlib": ckptlib, "L": bounded, "ModelCheckpoint": ModelCheckpoint, "net": net, "optim": optim}
    exec(code, ns)
    trainer = ns["trainer"]
    trainer.fit(lightning_run.Tiny(), lightning_run.data(), ckpt_path="ckpts/last.ckpt")  # resumes through ckptlib
    report(
        differences=differences(expected, full_state(net, optim)),
        step=ns["result"].step,
        resumed_to=trainer.global_step,
        committed=os.path.isfile("ckpts/last.ckpt/ckptlib.json"),
    )


if __name__ == "__main__":
    client, recipe, workdir = sys.argv[1:4]
    with open(recipe) as f:
        source = f.read()
    os.chdir(workdir)
    {"torchtitan": torchtitan, "huggingface": huggingface, "composer": composer, "lightning": lightning}[client](source)
