"""Unused-key reporting at its edges (`ckptlib.loading.load_checks`), single process: an entry
left out on purpose hides only its own keys (never another entry whose name it begins),
`only=` given as one string, `ignore_keys` patterns matched case-sensitively, keys a tied
weight loads through its alias, and the listing's elision after exactly 20 keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckptlib
from ckptlib.loading.load_checks import describe_unused, unused_candidates


def test_an_entry_left_out_hides_only_its_own_keys():
    saved = ["model.w", "model_ema.w", "model2.w", "optim.state"]
    assert unused_candidates(saved, set(), ["model"], None, []) == {"model_ema.w", "model2.w", "optim.state"}
    assert unused_candidates(saved, {"model2.w"}, ["model", "optim"], None, []) == {"model_ema.w"}


@pytest.mark.parametrize("only", ["model", ("model",), ["model"]], ids=["str", "tuple", "list"])
def test_only_as_a_string_is_one_entry(only):
    saved = ["model.a", "model.b", "optim.s", "step"]
    assert unused_candidates(saved, {"model.a"}, [], only, []) == {"model.b"}


def test_ignore_patterns_match_case_sensitively():
    saved = ["Model.w", "model.w", "head.bias"]
    assert unused_candidates(saved, set(), [], None, ["model.*", "head.*"]) == {"Model.w"}


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (1, "1 checkpoint key the state does not ask for: k00"),
        (2, "2 checkpoint keys the state does not ask for: k00, k01"),
        (20, "20 checkpoint keys the state does not ask for: " + ", ".join(f"k{i:02d}" for i in range(20))),
        (
            21,
            "21 checkpoint keys the state does not ask for: "
            + ", ".join(f"k{i:02d}" for i in range(20))
            + " ... (21 in all)",
        ),
    ],
)
def test_the_listing_shows_twenty_keys_and_elides_more(n, text):
    assert describe_unused([f"k{i:02d}" for i in range(n)]) == text


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_loads_every_key_and_leaves_none_unused(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "c")
    ckptlib.save(path, {"model": _Tied(), "step": 1})
    model = _Tied()
    with torch.no_grad():
        model.embed.weight.zero_()
    result = ckptlib.load(path, {"model": model, "step": -1}, allow_unused=False)
    assert result.unused_keys == []
    torch.manual_seed(0)
    assert torch.equal(model.head.weight, _Tied().embed.weight) and model.head.weight is model.embed.weight


def test_only_as_a_string_lists_the_model_s_unused_keys(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "c")
    big = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    ckptlib.save(path, {"model": big, "optim": {"lr": 0.1}, "step": 1})
    small = nn.Sequential(nn.Linear(2, 2))
    result = ckptlib.load(path, {"model": small, "step": -1}, only="model")
    assert result.unused_keys == ["model.1.bias", "model.1.weight"]
    assert torch.equal(small[0].weight, big[0].weight)
