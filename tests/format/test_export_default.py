"""`ckpt export` / `ckptlib.export` write the model alone by default (issue "The first week",
item 3): a {"model", "optim"} checkpoint exports `model.state_dict()`'s names, tied head once,
loadable by transformers' `from_pretrained` bit-exactly; `--all` / `model_only=False` every
tensor under its full key; a plain model state dict every tensor; a state of other entries
("net" + "optim") is refused, naming them, until `--prefix` says which is the model."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.errors import StateError
from ckptlib.offline.export import EXPORT_RECORD

st = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

TIED = {"tied": True, "untied": False}


def _tiny_llama(tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def _saved(tmp_path, tied: bool):
    model, optim = _tiny_llama(tied)
    src = str(tmp_path / "ckpt")
    ckptlib.save(src, {"model": model, "optim": optim}, step=1)
    return src, model


def _hf_names(model, tmp_path) -> set[str]:
    """The names transformers' own save_pretrained writes (tied names once)."""
    out = tmp_path / "by-transformers"
    model.save_pretrained(str(out))
    return set(st.load_file(str(out / "model.safetensors")))


def _export(how: str, src: str, dst: str) -> None:
    if how == "api":
        ckptlib.export(src, dst)
    else:
        assert cli_main(["export", src, dst, "--no-progress"]) == 0


@pytest.mark.parametrize("how", ["api", "cli"])
@pytest.mark.parametrize("tied", list(TIED), ids=list(TIED))
def test_default_export_is_the_model_alone_and_from_pretrained_loads_it_bit_exactly(tmp_path, how, tied):
    src, model = _saved(tmp_path, TIED[tied])
    out = tmp_path / "hf"
    model.config.save_pretrained(str(out))  # config first, then the weights
    _export(how, src, str(out))
    written = st.load_file(str(out / "model.safetensors"))
    expected_names = _hf_names(model, tmp_path)
    assert set(written) == expected_names
    assert set(written) == set(model.state_dict()) - ({"lm_head.weight"} if TIED[tied] else set())
    assert not [k for k in written if k.startswith(("optim", "model.model."))]
    record = json.loads((out / EXPORT_RECORD).read_text())
    assert record["model_only"] is True
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is TIED[tied]


def _optim_tensors(optim, model) -> dict[str, torch.Tensor]:
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for param, slots in optim.state.items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.state.{names[param]}.{slot}"] = value
    return out


@pytest.mark.parametrize("how", ["api", "cli"])
def test_all_writes_every_tensor_under_its_full_key(tmp_path, how):
    src, model = _saved(tmp_path, False)
    twin, optim = _tiny_llama(False)  # the same seed and step: the same weights and moments
    out = str(tmp_path / "all")
    if how == "api":
        result = ckptlib.export(src, out, model_only=False)
        assert result.tied == {}
    else:
        assert cli_main(["export", src, out, "--all", "--no-progress"]) == 0
    written = st.load_file(os.path.join(out, "model.safetensors"))
    want = {f"model.{k}": v for k, v in model.state_dict().items()} | _optim_tensors(optim, twin)
    assert any(k.endswith(".exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)
    assert set(written) == set(want)
    for name, value in want.items():
        assert torch.equal(written[name], value), name
    assert json.loads(open(os.path.join(out, EXPORT_RECORD)).read())["model_only"] is False


FLAT = {
    "layers.0.weight": torch.arange(6.0).reshape(2, 3),
    "layers.0.bias": torch.ones(2),
    "embed.weight": torch.eye(3),
}


@pytest.mark.parametrize("how", ["api", "cli"])
def test_a_plain_model_state_dict_exports_every_tensor(tmp_path, how):
    src = str(tmp_path / "flat")
    ckptlib.save(src, {k: v.clone() for k, v in FLAT.items()}, step=2)
    out = str(tmp_path / "out")
    _export(how, src, out)
    written = st.load_file(os.path.join(out, "model.safetensors"))
    assert set(written) == set(FLAT)
    assert all(torch.equal(written[k], v) for k, v in FLAT.items())
    assert json.loads(open(os.path.join(out, EXPORT_RECORD)).read())["model_only"] is False


@pytest.mark.parametrize("tied", list(TIED), ids=list(TIED))
def test_a_flat_transformers_state_dict_keeps_its_own_model_dot_names(tmp_path, tied):
    """`LlamaForCausalLM.state_dict()` saved as is names "model.embed_tokens.weight" and
    "lm_head.weight": no "model" entry (DCP saved it flat), so every tensor, under its name."""
    model, _ = _tiny_llama(TIED[tied])
    src, out = str(tmp_path / "flat-hf"), tmp_path / "hf"
    ckptlib.save(src, {k: v.detach().clone() for k, v in model.state_dict().items()}, step=1)
    model.config.save_pretrained(str(out))
    result = ckptlib.export(src, str(out))
    assert set(st.load_file(str(out / "model.safetensors"))) == _hf_names(model, tmp_path)
    assert result.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if TIED[tied] else {})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    got, want = loaded.state_dict(), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is TIED[tied]


OTHER_ENTRIES = {
    "net+optim": lambda net: {"net": net, "optim": {"state": {"w": {"exp_avg": torch.zeros(2)}}}},
    "net+optimizer-moments": lambda net: {"net": net, "opt": {"state": {"w": {"exp_avg_sq": torch.zeros(2)}}}},
    "net+param_groups": lambda net: {"net": net, "o": {"param_groups": [{"lr": torch.tensor(0.1)}]}},
}


@pytest.mark.parametrize("layout", list(OTHER_ENTRIES))
def test_a_state_of_other_entries_is_refused_until_prefix_names_the_model(tmp_path, capsys, layout):
    net = {"w": torch.arange(2.0), "b": torch.ones(2)}
    state = OTHER_ENTRIES[layout]({k: v.clone() for k, v in net.items()})
    src = str(tmp_path / "ckpt")
    ckptlib.save(src, state, step=4)
    entries = ", ".join(sorted(state))
    message = (
        f"{src}: no 'model' entry to export as the model (entries: {entries}); pass prefix= (CLI --prefix) to "
        "name the model's entry, or model_only=False (CLI --all) for every tensor"
    )
    with pytest.raises(StateError, match=re.escape(message) + "$"):
        ckptlib.export(src, str(tmp_path / "refused"))
    assert not os.path.exists(tmp_path / "refused")
    capsys.readouterr()
    assert cli_main(["export", src, str(tmp_path / "refused"), "--no-progress"]) == 1
    assert message in capsys.readouterr().err and not os.path.exists(tmp_path / "refused")
    for how in ("api", "cli"):
        out = str(tmp_path / f"net-{how}")
        if how == "api":
            ckptlib.export(src, out, prefix="net")
        else:
            assert cli_main(["export", src, out, "--prefix", "net", "--no-progress"]) == 0
        written = st.load_file(os.path.join(out, "model.safetensors"))
        assert set(written) == set(net) and all(torch.equal(written[k], v) for k, v in net.items())


def test_model_only_true_without_a_model_entry_is_an_error(tmp_path):
    src = str(tmp_path / "flat")
    ckptlib.save(src, {k: v.clone() for k, v in FLAT.items()}, step=2)
    with pytest.raises(StateError, match="no tensors to export of the model"):
        ckptlib.export(src, str(tmp_path / "out"), model_only=True)


@pytest.mark.parametrize("other", [["--model-only"], ["--prefix", "model"]], ids=["model-only", "prefix"])
def test_all_with_model_only_or_prefix_is_a_usage_error(tmp_path, capsys, other):
    src, _ = _saved(tmp_path, False)
    assert cli_main(["export", src, str(tmp_path / "out"), "--all", *other]) == 2
    assert "--all writes every tensor; it cannot be combined with --model-only or --prefix" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
