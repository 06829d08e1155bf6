"""A first week's mistakes, each a StateError or MissingKeysError that shows the right call.

Before: `ckptlib.save({"model": m}, path)` (DCP's argument order) raised `AttributeError: 'dict'
object has no attribute 'uri'` (load and async_save alike); `ckptlib.load(path, module)` a
TypeError; a renamed layer's MissingKeysError listed only the missing keys, and a flat
`model.state_dict()` got no hint to wrap it as {"model": ...}.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ckptlib
from ckptlib import MissingKeysError, StateError


class Net(nn.Module):
    def __init__(self, head: str = "head"):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 3)
        setattr(self, head, nn.Linear(3, 2))


@pytest.fixture
def saved(tmp_path) -> str:
    path = str(tmp_path / "ckpt")
    ckptlib.save(path, {"model": Net("head")})
    return path


CALLS = {
    "save": lambda uri, state: ckptlib.save(uri, state),
    "async_save": lambda uri, state: ckptlib.async_save(uri, state).wait(),
    "load": lambda uri, state: ckptlib.load(uri, state),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_dcp_argument_order_shows_the_right_call(tmp_path, call):
    path = str(tmp_path / "c")
    with pytest.raises(StateError) as caught:
        CALLS[call]({"model": Net()}, path)
    assert str(caught.value) == (
        f"ckptlib.{call}(uri, state) takes the path first: call ckptlib.{call}({path!r}, state) "
        f"(DCP's dcp.{call}(state_dict, checkpoint_id=...) takes them the other way round)"
    )
    assert caught.value.path == path
    assert not os.path.exists(path)  # nothing written


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_module_as_the_state_says_to_wrap_it(tmp_path, call):
    path = str(tmp_path / "c")
    with pytest.raises(StateError) as caught:
        CALLS[call](path, Net())
    assert str(caught.value) == (
        f"ckptlib.{call}({path!r}, state): state must be a mapping of names to objects, got the module Net: "
        "pass {'model': model}"
    )
    assert not os.path.exists(path)


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("uri", [3, None, b"/tmp/x"], ids=["int", "none", "bytes"])
def test_a_uri_that_is_not_one(call, uri):
    with pytest.raises(StateError) as caught:
        CALLS[call](uri, {"model": Net()})
    assert str(caught.value) == (
        f"ckptlib.{call}(uri, state): uri must be a path, a URI (file://, s3://, gs://, az://) or a Storage, "
        f"got {type(uri).__name__}"
    )


def test_a_state_that_is_not_a_mapping(tmp_path):
    with pytest.raises(StateError) as caught:
        ckptlib.save(str(tmp_path / "c"), [torch.ones(2)])
    assert "state must be a mapping of names to objects (e.g. {'model': model, 'optim': optim}), got list" in str(
        caught.value
    )


def test_a_renamed_layer_lists_the_unused_keys_and_the_rename(saved):
    state = {"model": Net("out")}
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(saved, state)
    err = caught.value
    assert err.keys == ["model.out.bias", "model.out.weight"]
    assert err.unused == ["model.head.bias", "model.head.weight"]
    assert str(err) == (
        f"{saved} lacks keys the state asks for: model.out.bias, model.out.weight; the checkpoint has "
        "model.head.bias, model.head.weight that the state does not ask for: if the layer was renamed, load with "
        "rename={'model.head.': 'model.out.'}"
    )
    # the suggestion works, bit-exactly
    ckptlib.load(saved, state, rename={"model.head.": "model.out."})
    assert torch.equal(state["model"].out.weight, Net("head").head.weight)


def test_no_rename_is_suggested_between_tensors_of_other_shapes(saved):
    class Wider(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 3)
            self.out = nn.Linear(3, 5)  # the saved head is (2, 3)

    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(saved, {"model": Wider()})
    assert "rename=" not in str(caught.value)
    assert str(caught.value).endswith(
        "; the checkpoint's keys the state does not ask for: model.head.bias, model.head.weight"
    )
    assert caught.value.unused == ["model.head.bias", "model.head.weight"]


def test_a_flat_state_dict_is_told_to_wrap_it(saved):
    flat = Net("head").state_dict()
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(saved, flat)
    assert str(caught.value) == (
        f"{saved} lacks keys the state asks for: body.bias, body.weight, head.bias, head.weight; the state is a "
        "flat state dict (tensors at its top level) and the checkpoint keeps these keys under 'model' "
        "(model.body.bias, ...): pass {'model': model} (the module, or its state_dict) as the state"
    )
    ckptlib.load(saved, {"model": flat})  # the advice works
    assert torch.equal(flat["head.weight"], Net("head").head.weight)


def test_a_mistyped_entry_still_gets_did_you_mean(saved):
    with pytest.raises(MissingKeysError) as caught:
        ckptlib.load(saved, {"modle": Net("head")})
    assert "the state's 'modle' is not in the checkpoint, which has 'model': did you mean it?" in str(caught.value)
    assert "rename=" not in str(caught.value)


MANAGER_CALLS = {
    "save": lambda mgr, step, state: mgr.save(step, state),
    "maybe_save": lambda mgr, step, state: mgr.maybe_save(step, state, force=True),
}


@pytest.mark.parametrize("call", sorted(MANAGER_CALLS))
def test_manager_save_with_the_state_first(tmp_path, call):
    mgr = ckptlib.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(StateError) as caught:
        MANAGER_CALLS[call](mgr, {"model": Net()}, 5)
    assert str(caught.value) == (
        f"CheckpointManager.{call}(step, state) takes the step first: call manager.{call}(5, state)"
    )
    mgr.close()
    assert not os.path.exists(tmp_path / "run" / "step_0000000005")


@pytest.mark.parametrize("call", ["load", "save", "maybe_save"])
def test_manager_given_a_path_or_a_module_as_the_state(tmp_path, saved, call):
    root = str(tmp_path / "run")
    mgr = ckptlib.CheckpointManager(root)
    run = {
        "load": lambda state: mgr.load(state),
        "save": lambda state: mgr.save(1, state),
        "maybe_save": lambda state: mgr.maybe_save(1, state, force=True),
    }[call]
    with pytest.raises(StateError) as caught:
        run(saved)
    assert str(caught.value) == (
        f"CheckpointManager.{call}(state): state must be a mapping of names to objects, got the path {saved!r}: "
        f"the manager reads and writes its own root ({root}); to load a checkpoint elsewhere, call "
        "ckptlib.load(path, state) or give CheckpointManager(initial_load=path)"
    )
    with pytest.raises(StateError) as caught:
        run(Net())
    assert str(caught.value) == (
        f"CheckpointManager.{call}: state must be a mapping of names to objects, got the module Net: "
        "pass {'model': model}"
    )
    mgr.close()
