"""Flat dotted-key state dicts: `model.state_dict()` itself (keys like '0.weight'), what
`dcp.save(model.state_dict())` writes, saves and loads like a nested state, bit-exact, at any
world size, and interoperates with plain `dcp.save`/`dcp.load` in both directions."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import ckptlib
from ckptlib._torch import parallel
from ckptlib.format import summarize


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.LayerNorm(3))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _quiet_dcp(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming a single process"
        return fn(*args, **kwargs)


def test_flat_state_dict_round_trip_and_keys(tmp_path):
    uri = str(tmp_path / "ckpt")
    saved = _model(0)
    ckptlib.save(uri, saved.state_dict(), step=3)
    assert sorted(t["key"] for t in summarize(uri).tensors) == sorted(saved.state_dict())
    target = _model(1)
    result = ckptlib.load(uri, target.state_dict())  # loads in place into the module's tensors
    assert result.step == 3 and result.missing_keys == []
    assert _equal(target.state_dict(), saved.state_dict())


def test_plain_dcp_save_of_a_flat_state_dict_loads_through_ckptlib(tmp_path):
    uri = str(tmp_path / "plain")
    saved = _model(0)
    _quiet_dcp(dcp.save, saved.state_dict(), checkpoint_id=uri)
    target = _model(1)
    assert ckptlib.load(uri, target.state_dict()).format == "dcp"
    assert _equal(target.state_dict(), saved.state_dict())


def test_ckptlib_save_of_a_flat_state_dict_loads_through_plain_dcp(tmp_path):
    uri = str(tmp_path / "ckpt")
    saved = _model(0)
    ckptlib.save(uri, saved.state_dict())
    target = _model(1)
    state = target.state_dict()
    _quiet_dcp(dcp.load, state, checkpoint_id=uri)
    assert _equal(target.state_dict(), saved.state_dict())


def test_flat_keys_mix_with_nested_entries_and_strict_names_missing_flat_keys(tmp_path):
    uri = str(tmp_path / "ckpt")
    saved = _model(0)
    ckptlib.save(uri, {**saved.state_dict(), "step": 5, "extra": {"lr": 0.5}})
    target = _model(1)
    state = {**target.state_dict(), "step": 0, "extra": {"lr": 0.0}}
    ckptlib.load(uri, state)
    assert state["step"] == 5 and state["extra"] == {"lr": 0.5}
    assert _equal(target.state_dict(), saved.state_dict())
    wider = {**_model(2).state_dict(), "4.weight": torch.zeros(3)}
    with pytest.raises(ckptlib.MissingKeysError) as caught:
        ckptlib.load(uri, wider)
    assert str(caught.value).endswith(
        "lacks keys the state asks for: 4.weight; the checkpoint's keys the state does not ask for: extra.lr, step"
    )
    assert (caught.value.keys, caught.value.unused) == (["4.weight"], ["extra.lr", "step"])


def _fsdp2_flat(uri: str, seed: int, action: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    fully_shard = parallel.require_fsdp2_cpu()
    model = _model(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    state = model.state_dict()  # flat keys, DTensor shards
    assert all(isinstance(v, DTensor) for v in state.values())
    if action == "save":
        ckptlib.save(uri, state)
    else:
        ckptlib.load(uri, state)
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "save_ws,load_ws", [(2, 3), (3, 1)], ids=["save2-fsdp2-load3-fsdp2", "save3-fsdp2-load1-fsdp2"]
)
def test_flat_dtensor_state_dict_reshards(tmp_path, dist_run, save_ws, load_ws):
    if parallel.fsdp2_cpu_reason() is not None:
        pytest.skip(parallel.fsdp2_cpu_reason())
    uri = str(tmp_path / "ckpt")
    saved = dist_run(save_ws, _fsdp2_flat, uri, 0, "save")[0]
    assert _equal(saved, _model(0).state_dict())
    for loaded in dist_run(load_ws, _fsdp2_flat, uri, 1, "load"):
        assert _equal(loaded, saved)
