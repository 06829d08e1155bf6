"""Aliased (tied) parameters: stored once, loaded into every alias. Both names stay in
`.metadata` with storage records naming the same bytes (plain `dcp.load` reads either), and a
checkpoint holding one name of a tied pair satisfies a strict load of the other (transformers'
`save_pretrained` stores only `embed_tokens.weight` of a tied model)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

import ckptlib
from ckptlib._torch import parallel
from ckptlib.format import open_checkpoint
from ckptlib.storage import as_storage

VOCAB, DIM = 64, 16


class Tied(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def _tied(seed: int, tie: bool = True) -> Tied:
    torch.manual_seed(seed)
    return Tied(tie)


def _records(uri: str) -> dict[str, tuple]:
    """{key: the (file, offset, length) of each stored chunk} from `.metadata`."""
    out: dict[str, list] = {}
    for index, info in open_checkpoint(as_storage(uri)).metadata.storage_data.items():
        out.setdefault(index.fqn, []).append((info.relative_path, info.offset, info.length))
    return {key: tuple(sorted(v)) for key, v in out.items()}


def _shard_bytes(uri: str) -> int:
    return sum(os.path.getsize(os.path.join(uri, n)) for n in os.listdir(uri) if n.endswith(".distcp"))


def test_tied_weight_is_stored_once_under_both_names(tmp_path):
    tied, untied = str(tmp_path / "tied"), str(tmp_path / "untied")
    ckptlib.save(tied, {"model": _tied(0)})
    ckptlib.save(untied, {"model": _tied(0, tie=False)})
    records = _records(tied)
    assert records["model.head.weight"] == records["model.embed.weight"]
    assert _records(untied)["model.head.weight"] != _records(untied)["model.embed.weight"]
    embedding = VOCAB * DIM * 4
    assert _shard_bytes(untied) - _shard_bytes(tied) >= embedding  # one copy fewer
    assert ckptlib.format.verify(tied) == []
    for target in (_tied(1), _tied(1, tie=False)):  # into a tied and an untied model
        ckptlib.load(tied, {"model": target})
        assert torch.equal(target.head.weight, _tied(0).embed.weight)
        assert torch.equal(target.embed.weight, _tied(0).embed.weight)
    plain = {"model": _tied(2, tie=False).state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(plain, checkpoint_id=tied)  # plain DCP reads both names
    assert torch.equal(plain["model"]["head.weight"], _tied(0).embed.weight)


def test_one_name_of_a_tied_pair_satisfies_a_strict_load_of_the_other(tmp_path):
    source = _tied(0)
    # transformers' save_pretrained layout: a tied model's head is not stored
    stored = {k: v.contiguous() for k, v in source.state_dict().items() if k != "head.weight"}
    path = str(tmp_path / "model.safetensors")
    save_file(stored, path)
    target = _tied(1)
    result = ckptlib.load(path, {"model": target})
    assert result.missing_keys == []
    assert torch.equal(target.head.weight, source.embed.weight) and torch.equal(target.body.weight, source.body.weight)
    assert any("model.head.weight from model.embed.weight" in note for note in result.notes)
    with pytest.raises(ckptlib.MissingKeysError, match=r"lacks keys the state asks for: model\.head\.weight$"):
        ckptlib.load(path, {"model": _tied(1, tie=False)})  # an untied head has nothing to fill it
    untied = _tied(3, tie=False)
    assert ckptlib.load(path, {"model": untied}, strict=False).missing_keys == ["model.head.weight"]


def test_ckptlib_checkpoint_holding_only_one_name_loads_a_tied_model(tmp_path):
    uri = str(tmp_path / "ckpt")
    source = _tied(0)
    ckptlib.save(uri, {"model": {k: v for k, v in source.state_dict().items() if k != "head.weight"}})
    target = _tied(1)
    ckptlib.load(uri, {"model": target})
    assert torch.equal(target.head.weight, source.embed.weight)


def _fsdp2_tied(uri: str, seed: int, action: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = parallel.require_fsdp2_cpu()
    model = _tied(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.arange(8).reshape(2, 4)).sum().backward()
    optim.step()
    state = {"model": model, "optim": optim}
    if action == "save":
        ckptlib.save(uri, state)
    else:
        ckptlib.load(uri, state)
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def _replicated_tied(uri: str) -> None:
    ckptlib.save(uri, {"model": _tied(0)})  # every rank holds the whole model


@pytest.mark.parametrize("save_ws,load_ws", [(2, 3)], ids=["save2-fsdp2-load3-fsdp2"])
def test_tied_fsdp2_weight_stored_once_and_resharded(tmp_path, dist_run, save_ws, load_ws):
    if parallel.fsdp2_cpu_reason() is not None:
        pytest.skip(parallel.fsdp2_cpu_reason())
    uri = str(tmp_path / "ckpt")
    saved = dist_run(save_ws, _fsdp2_tied, uri, 0, "save")[0]
    records = _records(uri)
    assert records["model.head.weight"] == records["model.embed.weight"] and len(records["model.embed.weight"]) == 2
    for loaded in dist_run(load_ws, _fsdp2_tied, uri, 1, "load"):
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_replicated_tied_weight_is_written_once_by_one_rank(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    dist_run(2, _replicated_tied, uri)
    records = _records(uri)
    assert records["model.head.weight"] == records["model.embed.weight"]
    target = _tied(1)
    ckptlib.load(uri, {"model": target})
    assert torch.equal(target.head.weight, _tied(0).embed.weight)
