"""Training states beyond one model and one optimizer, each round-tripped across a resize.

Every scenario builds its parts (models, optimizers paired with their model, stateful
extras such as schedulers and grad scalers) at a world size, trains, saves through
ckptlib, loads at another world size, checks every part bit-exactly, then trains one more
step and compares with a run that got the same state without a checkpoint (set directly
from the saved full state).

Scenarios: ``gan`` (two model/optimizer pairs), ``frozen`` (parameters not in the
optimizer), ``tied`` (head tied to the embedding, saved with TP, loaded with FSDP2),
``param_groups`` (two groups, different lr/weight decay), ``lr_scheduler``,
``grad_scaler`` (``torch.amp.GradScaler`` on CPU), ``compiled`` (``torch.compile``,
backend "eager": the FQNs gain ``_orig_mod.``; inductor would need a C++ compiler and
minutes per rank), ``activation_checkpointing`` (``checkpoint_wrapper``: FQNs gain
``_checkpoint_wrapped_module.``) and ``mixed_precision`` (FSDP2 with bf16 compute and fp32
sharded parameters, which are what is saved).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckptlib._torch import parallel
from ckptlib.testing.matrices import layout_matrix, matrix
from ckptlib.testing.matrices import parallel_layouts as lay
from ckptlib.testing.matrices.models import build_transformer, transformer_loss

FULL = StateDictOptions(full_state_dict=True)


@dataclasses.dataclass
class Parts:
    models: dict[str, nn.Module]
    optims: dict[str, tuple[torch.optim.Optimizer, str]]  # name -> (optimizer, its model's name)
    extras: dict[str, Any]  # objects with state_dict()/load_state_dict()
    step: Callable[["Parts", int], None]

    def state(self, step: int) -> dict[str, Any]:
        """The mapping handed to ckptlib.save/load."""
        return {**self.models, **{k: o for k, (o, _) in self.optims.items()}, **self.extras, "step": step}

    def full(self) -> dict[str, Any]:
        """Every part's unsharded state as CPU tensors and plain values (collective)."""
        out: dict[str, Any] = {}
        for name, model in self.models.items():
            out[name] = matrix._to_cpu(get_model_state_dict(model, options=FULL))
        for name, (opt, owner) in self.optims.items():
            osd = matrix._to_cpu(get_optimizer_state_dict(self.models[owner], opt, options=FULL))
            for group in osd.get("param_groups", []):
                group["params"] = sorted(group["params"])
            out[name] = osd
        for name, obj in self.extras.items():
            out[name] = matrix._to_cpu(copy.deepcopy(obj.state_dict()))
        return out

    def set_full(self, full: dict[str, Any]) -> None:
        """Give every part the state in `full` without a checkpoint (the reference run)."""
        for name, model in self.models.items():
            layout_matrix.set_full_model(model, full[name])
        for name, (opt, owner) in self.optims.items():
            layout_matrix.set_full_optimizer(self.models[owner], opt, full[name])
        for name, obj in self.extras.items():
            obj.load_state_dict(copy.deepcopy(full[name]))


def _step_all(parts: Parts, loss: torch.Tensor) -> None:
    loss.backward()
    for opt, _ in parts.optims.values():
        opt.step()
        opt.zero_grad(set_to_none=True)


def _transformer_step(parts: Parts, step: int) -> None:
    _step_all(parts, transformer_loss(parts.models["model"], step))
    for extra in parts.extras.values():
        if isinstance(extra, torch.optim.lr_scheduler.LRScheduler):
            extra.step()


def _fsdp2(model: nn.Module, group, **kw) -> nn.Module:
    return lay.apply_layout(model, "fsdp2", group=group, **kw)


def _transformer_parts(seed: int, group, *, layout: str = "fsdp2", param_groups=None, extras=None, **kw) -> Parts:
    model = lay.apply_layout(build_transformer(seed), layout, group=group, **kw)
    params = param_groups(model) if param_groups else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    parts = Parts({"model": model}, {"optim": (opt, "model")}, {}, _transformer_step)
    if extras:
        parts.extras.update(extras(opt))
    return parts


# --------------------------------------------------------------------------- scenarios


class _Generator(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))


class _Discriminator(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(5, 11), nn.LeakyReLU(0.2), nn.Linear(11, 1))


def _gan_step(parts: Parts, step: int) -> None:
    gen, disc = parts.models["generator"], parts.models["discriminator"]
    (g_opt, _), (d_opt, _) = parts.optims["generator_optim"], parts.optims["discriminator_optim"]
    rng = torch.Generator().manual_seed(3000 + step)
    noise, real = torch.randn(8, 7, generator=rng), torch.randn(8, 5, generator=rng) + 1.0
    fake = gen(noise)
    d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
    d_loss.backward()
    d_opt.step()
    d_opt.zero_grad(set_to_none=True)
    g_loss = F.softplus(-disc(fake)).mean()
    g_loss.backward()
    g_opt.step()
    g_opt.zero_grad(set_to_none=True)
    d_opt.zero_grad(set_to_none=True)  # the generator step also reached the discriminator's grads


def gan(seed: int, group=None) -> Parts:
    torch.manual_seed(seed)
    gen = _fsdp2(_Generator(), group, fsdp_units=())
    disc = _fsdp2(_Discriminator(), group, fsdp_units=())
    return Parts(
        {"generator": gen, "discriminator": disc},
        {
            "generator_optim": (torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999)), "generator"),
            "discriminator_optim": (torch.optim.AdamW(disc.parameters(), lr=1e-3), "discriminator"),
        },
        {},
        _gan_step,
    )


def frozen(seed: int, group=None) -> Parts:
    model = build_transformer(seed)
    for param in (*model.embed.parameters(), *model.blocks[0].attn.parameters()):
        param.requires_grad_(False)  # the embedding (and the tied head) and one attention
    model = _fsdp2(model, group)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    return Parts({"model": model}, {"optim": (opt, "model")}, {}, _transformer_step)


def tied(seed: int, group=None, *, layout: str = "tp") -> Parts:
    return _transformer_parts(seed, group, layout=layout)


def _two_groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [
        {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
        {"params": no_decay, "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)},
    ]


def param_groups(seed: int, group=None) -> Parts:
    return _transformer_parts(seed, group, param_groups=_two_groups)


def lr_scheduler(seed: int, group=None) -> Parts:
    def extras(opt):
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return {"scheduler": torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[3])}

    return _transformer_parts(seed, group, param_groups=_two_groups, extras=extras)


def _scaler_step(parts: Parts, step: int) -> None:
    scaler = parts.extras["scaler"]
    opt, _ = parts.optims["optim"]
    scaler.scale(transformer_loss(parts.models["model"], step)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def grad_scaler(seed: int, group=None) -> Parts:
    parts = _transformer_parts(seed, group, layout="ddp")
    # growth_interval=2: the scale and the growth tracker both change over the steps.
    parts.extras["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    parts.step = _scaler_step
    return parts


def compiled(seed: int, group=None) -> Parts:
    parts = _transformer_parts(seed, group)
    parts.models["model"] = torch.compile(parts.models["model"], backend="eager")
    return parts


def activation_checkpointing(seed: int, group=None) -> Parts:
    model = build_transformer(seed)
    wrap = parallel.checkpoint_wrapper_fn()
    model.blocks = nn.ModuleList(wrap(block) for block in model.blocks)
    model = _fsdp2(model, group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return Parts({"model": model}, {"optim": (opt, "model")}, {}, _transformer_step)


def mixed_precision(seed: int, group=None) -> Parts:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _transformer_parts(seed, group, mp_policy=policy)


SCENARIOS: dict[str, Callable[..., Parts]] = {
    fn.__name__: fn
    for fn in (
        gan,
        frozen,
        tied,
        param_groups,
        lr_scheduler,
        grad_scaler,
        compiled,
        activation_checkpointing,
        mixed_precision,
    )
}
#: Scenarios whose saved FQNs must not carry a wrapper's prefix.
NO_PREFIX = {"compiled": "_orig_mod.", "activation_checkpointing": "_checkpoint_wrapped_module."}


def _build(name: str, seed: int, group, load: bool) -> Parts:
    if name == "tied" and load:
        return tied(seed, group, layout="fsdp2")
    return SCENARIOS[name](seed, group)


def save_scenario(uri: str, name: str, *, steps: int = 3, group=None) -> dict[str, Any]:
    """Train `steps` steps of scenario `name` on this group, save; return its full state."""
    import ckptlib

    parts = _build(name, 0, group, load=False)
    for step in range(steps):
        parts.step(parts, step)
    ckptlib.save(uri, parts.state(steps), step=steps, process_group=group)
    return parts.full()


def load_scenario(uri: str, name: str, expected: dict[str, Any], *, steps: int = 3, group=None) -> list[str]:
    """Load scenario `name` here; compare; one more step against a never-checkpointed run."""
    import ckptlib

    parts = _build(name, 1, group, load=True)
    state = parts.state(-1)
    result = ckptlib.load(uri, state, process_group=group)
    problems = [] if state["step"] == steps == result.step else [f"step {state['step']!r}, expected {steps}"]
    problems += matrix.differences(expected, parts.full(), "after-load")
    problems += _scenario_checks(name, parts, uri)
    parts.step(parts, steps)
    resumed = parts.full()
    reference = _build(name, 2, group, load=True)
    reference.set_full(expected)
    reference.step(reference, steps)
    problems += matrix.differences(reference.full(), resumed, "train-after-load")
    return problems


def _scenario_checks(name: str, parts: Parts, uri: str) -> list[str]:
    """What a bit-exact state comparison alone would not show."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(uri).read_metadata().state_dict_metadata)
    problems = []
    prefix = NO_PREFIX.get(name)
    if prefix:
        problems += [f"saved key {k!r} carries {prefix!r}" for k in keys if prefix in k]
    if name == "mixed_precision":
        meta = FileSystemReader(uri).read_metadata().state_dict_metadata
        for key, item in meta.items():
            dtype = getattr(getattr(item, "properties", None), "dtype", None)
            if key.startswith("model.") and dtype is not None and dtype != torch.float32:
                problems.append(f"{key} saved as {dtype}, expected the fp32 sharded parameter")
    if name == "frozen":
        saved_optim = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
        if any(k.startswith("embed.") for k in saved_optim):
            problems.append("frozen parameters have optimizer state")
    if name in ("tied", "frozen"):
        inner = parts.models["model"]
        if inner.head.weight is not inner.embed.weight:
            problems.append("head.weight is no longer embed.weight after the load")
    return problems
