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
from helpers.saved_state import shard_bytes
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


def _replicated_tied(uri: str, how: str = "save") -> None:
    _write(how, uri, {"model": _tied(0)})  # every rank holds the whole model


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


@pytest.mark.parametrize("how", ["save", "async-thread", "async-process"])
def test_replicated_tied_weight_is_written_once_by_one_rank(tmp_path, dist_run, how):
    uri = str(tmp_path / "ckpt")
    dist_run(2, _replicated_tied, uri, how)
    records = _records(uri)
    assert records["model.head.weight"] == records["model.embed.weight"]
    assert len(set(records.values())) == len(records) - 1  # every other item stored apart
    target = _tied(1)
    ckptlib.load(uri, {"model": target})
    assert torch.equal(target.head.weight, _tied(0).embed.weight)


# -- every writer stores a tied weight as `save` does ----------------------------------------
# An async save copies the state before writing; a copy per key broke the tie (the weight was
# stored twice and exported under both names). Every writer x staging option, and the
# manager's saves, must write the very checkpoint `save` writes.
CAP = 1 << 20  # AsyncMode(max_staging_bytes=): above every tensor of the model
WRITERS = {
    "async-thread": ckptlib.AsyncMode("thread"),
    "async-process": ckptlib.AsyncMode("process"),
    "async-thread-cap": ckptlib.AsyncMode("thread", max_staging_bytes=CAP),
    "async-process-cap": ckptlib.AsyncMode("process", max_staging_bytes=CAP),
    "async-thread-background-staging": ckptlib.AsyncMode("thread", background_staging=True),
    "async-process-background-staging": ckptlib.AsyncMode("process", background_staging=True),
}


def _trained(seed: int) -> dict:
    """A tied model and an Adam that took one step (its state keyed once for the tied weight)."""
    model = _tied(seed)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.arange(8).reshape(2, 4)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": 3}


def _write(how: str, root: str, state: dict) -> str:
    """Save `state` the way `how` names; the checkpoint's directory."""
    if how == "save":
        ckptlib.save(root, state, step=3)
        return root
    if how.startswith("manager-"):
        writer = how[len("manager-") :]
        mode = False if writer == "sync" else WRITERS[f"async-{writer}"]
        with ckptlib.CheckpointManager(root, async_save=mode) as manager:
            manager.save(3, state)
            manager.wait()
            return manager.path(3)
    mode = WRITERS[how]
    ckptlib.async_save(
        root,
        state,
        step=3,
        async_mode=mode.writer,
        background_staging=mode.background_staging,
        max_staging_bytes=mode.max_staging_bytes,
    ).wait()
    return root


def _items(uri: str) -> tuple[set, set]:
    metadata = open_checkpoint(as_storage(uri)).metadata
    return set(metadata.state_dict_metadata), {(i.fqn, tuple(i.offset or ())) for i in metadata.storage_data}


@pytest.mark.parametrize("how", [*WRITERS, "manager-sync", "manager-thread", "manager-process", "manager-process-cap"])
def test_every_writer_stores_a_tied_weight_once_as_save_does(tmp_path, how):
    want = _write("save", str(tmp_path / "sync"), _trained(0))
    got = _write(how, str(tmp_path / how), _trained(0))
    assert sorted(os.listdir(got)) == sorted(os.listdir(want))  # the same files
    assert _items(got) == _items(want)  # the same keys and stored items
    assert _records(got) == _records(want)  # head and embed name the same bytes, as `save` stores them
    assert _records(got)["model.head.weight"] == _records(got)["model.embed.weight"]
    assert _shard_bytes(got) == _shard_bytes(want)
    assert shard_bytes(got) == shard_bytes(want)  # byte for byte
    expected = _trained(0)
    for tie in (True, False):  # into a tied model (with its optimizer) and an untied one
        target = _trained(1) if tie else {"model": _tied(1, tie=False), "step": 0}
        ckptlib.load(got, target)
        model = target["model"]
        assert torch.equal(model.embed.weight, expected["model"].embed.weight)
        assert torch.equal(model.head.weight, expected["model"].embed.weight)
        assert (model.head.weight is model.embed.weight) == tie  # a tied target stays tied
        assert target["step"] == 3
        if tie:
            loaded, saved = target["optim"].state_dict()["state"], expected["optim"].state_dict()["state"]
            assert loaded.keys() == saved.keys()
            assert all(torch.equal(loaded[p][k], saved[p][k]) for p in saved for k in saved[p])
    # exported as `save`'s checkpoint exports: the weight once, under the name it is tied to
    exported = {}
    for name, uri in (("sync", want), (how, got)):
        out = str(tmp_path / f"export-{name}")
        result = ckptlib.export(uri, out, model_only=True)
        exported[name] = (result.tied, open(os.path.join(out, "model.safetensors"), "rb").read())
    assert exported[how] == exported["sync"]
    assert exported[how][0] == {"embed.weight": "head.weight"}
