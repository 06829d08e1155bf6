"""Checkpoint keys the state leaves unused (issue 37, item 5): listed in
`LoadResult.unused_keys` and a note, an UnusedKeysError before anything is read with
`allow_unused=False`; keys left out on purpose (`only=`, `ignore_keys=`, other ranks'
per-rank state) are not unused, and a key any rank reads is not unused on any rank."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckptlib
from ckptlib import UnusedKeysError


def _layers(n: int, fill: float | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(n)))
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    return model


@pytest.fixture
def three_layers(tmp_path) -> str:
    path = str(tmp_path / "c")
    model = _layers(3)
    ckptlib.save(path, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "step": 5})
    return path


def test_a_smaller_model_lists_the_keys_it_leaves_unused(tmp_path):
    path = str(tmp_path / "c")
    ckptlib.save(path, {"model": _layers(3), "step": 5})
    model = _layers(2, fill=0.0)
    result = ckptlib.load(path, {"model": model})
    assert result.unused_keys == ["model.2.bias", "model.2.weight", "step"]
    assert torch.equal(model[1].weight, _layers(3)[1].weight)  # what it asks for is loaded
    assert "unused: 3 checkpoint keys the state does not ask for: model.2.bias, model.2.weight, step" in result.notes, (
        result.notes
    )


def test_a_state_without_the_optimizer_leaves_its_keys_unused(three_layers):
    result = ckptlib.load(three_layers, {"model": _layers(3, fill=0.0), "step": -1})
    assert result.unused_keys and all(key.startswith("optim.") for key in result.unused_keys), result.unused_keys


def test_only_the_model_leaves_the_rest_out_on_purpose(three_layers):
    model = _layers(3, fill=0.0)
    result = ckptlib.load(three_layers, {"model": model}, only=("model",), allow_unused=False)
    assert result.unused_keys == [] and not any("unused" in n for n in result.notes)
    assert torch.equal(model[2].bias, _layers(3)[2].bias)


def test_ignored_keys_are_not_unused(three_layers):
    model = _layers(3, fill=0.0)
    result = ckptlib.load(three_layers, {"model": model}, only=("model",), ignore_keys=["model.2.*"])
    assert result.unused_keys == []
    assert torch.equal(model[2].weight, torch.zeros(4, 4))  # ignored: left as it was


def test_allow_unused_false_refuses_before_reading(three_layers):
    model = _layers(2, fill=0.0)
    with pytest.raises(UnusedKeysError) as info:
        ckptlib.load(three_layers, {"model": model}, only=("model",), allow_unused=False)
    message = (
        f"{three_layers}: 2 checkpoint keys the state does not ask for: model.2.bias, model.2.weight; load them "
        "into the state, leave them out with only= or ignore_keys=, or pass allow_unused=True"
    )
    assert str(info.value) == message
    assert info.value.keys == ["model.2.bias", "model.2.weight"] and info.value.path == three_layers
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())  # nothing was read


def test_a_whole_checkpoint_into_a_whole_state_has_none_unused(three_layers):
    model = _layers(3, fill=0.0)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "step": -1}
    result = ckptlib.load(three_layers, state, allow_unused=False)
    assert result.unused_keys == [] and state["step"] == 5


def _load_one_layer_each(path: str, allow_unused: bool) -> tuple:
    """Rank r holds layer r only (as a pipeline stage would): layer 2 is read by nobody."""
    rank = dist.get_rank()
    full = _layers(3, fill=0.0)
    state = {"model": {f"{rank}.weight": full[rank].weight, f"{rank}.bias": full[rank].bias}}
    try:
        result = ckptlib.load(path, state, only=("model",), allow_unused=allow_unused)
    except UnusedKeysError as exc:
        return "UnusedKeysError", str(exc), exc.keys
    return "ok", result.unused_keys, torch.equal(full[rank].weight, _layers(3)[rank].weight)


@pytest.mark.parametrize("allow_unused", [True, False], ids=["listed", "refused"])
def test_a_key_some_rank_reads_is_used_on_every_rank(tmp_path, dist_run, allow_unused):
    path = str(tmp_path / "c")
    ckptlib.save(path, {"model": _layers(3)})
    outcomes = dist_run(2, _load_one_layer_each, path, allow_unused, timeout=120)
    if allow_unused:
        assert outcomes == [("ok", ["model.2.bias", "model.2.weight"], True)] * 2
    else:
        assert [o[0] for o in outcomes] == ["UnusedKeysError"] * 2 and outcomes[0] == outcomes[1]
        assert re.match(
            re.escape(f"{path}: 2 checkpoint keys the state does not ask for: model.2.bias"), outcomes[0][1]
        )


class Progress:
    """Per-rank state (as a data loader's position)."""

    def __init__(self, seen: int):
        self.seen = seen

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.seen = sd["seen"]


def _save_rank_state(path: str) -> None:
    ckptlib.save(path, {"model": _layers(1), "progress": ckptlib.RankLocal(Progress(dist.get_rank() + 10))})


def test_other_ranks_per_rank_state_is_not_unused_after_a_resize(tmp_path, dist_run):
    path = str(tmp_path / "c")
    dist_run(2, _save_rank_state, path, timeout=120)
    progress = Progress(-1)
    with pytest.warns(ckptlib.ResizeWarning, match="rank 0 restores saved rank 0's per-rank state"):
        result = ckptlib.load(path, {"model": _layers(1, fill=0.0), "progress": ckptlib.RankLocal(progress)})
    assert progress.seen == 10 and result.unused_keys == []
