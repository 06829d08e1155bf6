"""ckptlib.save / ckptlib.load: what lands on disk, what comes back, and every error."""

from __future__ import annotations

import json
import os
import types
import warnings
from collections.abc import MutableMapping

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import ckptlib
from ckptlib.errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointIncompleteError,
    CheckpointNotFoundError,
    MissingKeysError,
    NotACheckpointError,
    ShapeMismatchError,
    StateError,
)
from ckptlib.testing.matrices import matrix as mx


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 2, bias=False))


def _trained(seed: int = 0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _assert_same_module(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---------------------------------------------------------------- single process


def test_layout_and_manifest(tmp_path):
    model, opt = _trained()
    uri = tmp_path / "ckpt"
    result = ckptlib.save(uri, {"model": model, "optim": opt}, step=3, metadata={"run": "a", "lr": 0.1})
    assert sorted(os.listdir(uri)) == [".metadata", "__0_0.distcp", "ckptlib.json"]
    manifest = json.loads((uri / "ckptlib.json").read_text())
    assert manifest["format"] == "ckptlib" and manifest["format_version"] == 1
    assert manifest["world_size"] == 1 and manifest["step"] == 3
    assert manifest["metadata"] == {"run": "a", "lr": 0.1}
    assert manifest["torch_version"] == torch.__version__
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
    for name, record in manifest["files"].items():
        assert record["size"] == os.path.getsize(uri / name)
        assert sum(length for _, length, _ in record["items"]) == record["size"]
    assert result.total_bytes == sum(r["size"] for r in manifest["files"].values())


def test_round_trip_values_and_return(tmp_path):
    model, opt = _trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping the scheduler first is fine for this test
        sched.step()
    state = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "epoch": 4,
        "tag": "run-a",
        "extra": {"counts": torch.arange(6, dtype=torch.int64).reshape(2, 3), "nested": {"half": torch.ones(3).half()}},
    }
    ckptlib.save(tmp_path / "c", state, step=9, metadata={"note": "x"})

    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    counts = torch.zeros(2, 3, dtype=torch.int64)
    state2 = {
        "model": model2,
        "optim": opt2,
        "sched": sched2,
        "epoch": 0,
        "tag": "",
        "extra": {"counts": counts, "nested": {"half": torch.zeros(3).half()}},
    }
    result = ckptlib.load(tmp_path / "c", state2)
    assert (result.step, result.world_size, result.metadata, result.format) == (9, 1, {"note": "x"}, "ckptlib")
    assert result.missing_keys == []
    _assert_same_module(model, model2)
    assert mx.differences(opt.state_dict(), opt2.state_dict()) == []
    assert sched2.state_dict() == sched.state_dict()
    assert state2["epoch"] == 4 and state2["tag"] == "run-a"
    assert state2["extra"]["counts"] is counts and torch.equal(counts, torch.arange(6).reshape(2, 3))
    assert torch.equal(state2["extra"]["nested"]["half"], torch.ones(3).half())


def test_plain_dcp_load_reads_ckptlib_checkpoint(tmp_path):
    model, opt = _trained()
    ckptlib.save(tmp_path / "c", {"model": model, "optim": opt})
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "c"))
    for key, value in model.state_dict().items():
        assert torch.equal(target["model"][key], value), key


def test_model_only_load_from_full_checkpoint(tmp_path):
    model, opt = _trained()
    ckptlib.save(tmp_path / "c", {"model": model, "optim": opt, "epoch": 1})
    model2 = _model(5)
    result = ckptlib.load(tmp_path / "c", {"model": model2})
    _assert_same_module(model, model2)
    assert result.missing_keys == []


def test_strict_missing_keys_name_them(tmp_path):
    model, _ = _trained()
    ckptlib.save(tmp_path / "c", {"model": model})
    model2, opt2 = _trained(3)
    with pytest.raises(MissingKeysError) as info:
        ckptlib.load(tmp_path / "c", {"model": model2, "optim": opt2, "epoch": 0})
    err = info.value
    assert "epoch" in err.keys and "optim.state.0.weight.exp_avg" in err.keys
    assert str(tmp_path / "c") in str(err) and "lacks keys the state asks for" in str(err)
    assert "model.0.weight" not in err.keys


def test_non_strict_skips_and_reports_missing(tmp_path):
    model, _ = _trained()
    ckptlib.save(tmp_path / "c", {"model": model})
    model2 = _model(3)
    state = {"model": model2, "epoch": 7}
    result = ckptlib.load(tmp_path / "c", state, strict=False)
    assert result.missing_keys == ["epoch"]
    assert state["epoch"] == 7
    _assert_same_module(model, model2)


def test_shape_mismatch_names_key(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(4, 3)})
    with pytest.raises(ShapeMismatchError, match=r"w: shape \(4, 4\) in the state, \(4, 3\) in the checkpoint") as info:
        ckptlib.load(tmp_path / "c", {"w": torch.zeros(4, 4)})
    assert info.value.keys == ["w"]


def test_errors_nonexistent_and_not_a_checkpoint(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint at {missing}: the path does not exist"):
        ckptlib.load(missing, {"w": torch.zeros(1)})
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    with pytest.raises(
        NotACheckpointError, match=r"junk is not a checkpoint in any format ckptlib reads .*found: notes.txt"
    ):
        ckptlib.load(tmp_path / "junk", {"w": torch.zeros(1)})
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError):
        ckptlib.load(tmp_path / "empty", {"w": torch.zeros(1)})
    (tmp_path / "file.pt").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match=r"file.pt is not a checkpoint in any format ckptlib reads"):
        ckptlib.load(tmp_path / "file.pt", {"w": torch.zeros(1)})


def test_uncommitted_checkpoint_is_refused(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(3)})
    (tmp_path / "c" / "ckptlib.json").unlink()
    (tmp_path / "c" / "ckptlib.pending").write_text("{}")
    with pytest.raises(
        CheckpointIncompleteError, match="uncommitted checkpoint: a save started but never wrote ckptlib.json"
    ):
        ckptlib.load(tmp_path / "c", {"w": torch.zeros(3)})


def test_manifest_file_mismatch_is_corrupt(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(3)})
    with open(tmp_path / "c" / "__0_0.distcp", "ab") as f:
        f.write(b"\0")
    with pytest.raises(
        CheckpointCorruptError, match=r"__0_0.distcp \(rank 0's shard\) has \d+ bytes, the manifest says \d+"
    ):
        ckptlib.load(tmp_path / "c", {"w": torch.zeros(3)})


def test_bit_flip_is_detected(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.arange(1000, dtype=torch.float32)})
    path = tmp_path / "c" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0.distcp: checksum mismatch in tensor 'w' at offset 0"):
        ckptlib.load(tmp_path / "c", {"w": torch.zeros(1000)})


def test_save_refuses_to_overwrite_committed(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(2)})
    with pytest.raises(CheckpointExistsError, match="already holds a committed checkpoint"):
        ckptlib.save(tmp_path / "c", {"w": torch.zeros(2)})
    loaded = torch.zeros(2)
    ckptlib.load(tmp_path / "c", {"w": loaded})
    assert torch.equal(loaded, torch.ones(2))
    ckptlib.save(tmp_path / "c", {"w": torch.full((2,), 5.0)}, overwrite=True)
    ckptlib.load(tmp_path / "c", {"w": loaded})
    assert torch.equal(loaded, torch.full((2,), 5.0))


def test_save_refuses_foreign_directory(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointExistsError, match="not empty and not a ckptlib checkpoint"):
        ckptlib.save(tmp_path / "c", {"w": torch.ones(2)})
    assert (tmp_path / "c" / "precious.txt").read_text() == "keep me"


def test_save_replaces_debris_of_crashed_save(tmp_path):
    target = tmp_path / "c"
    target.mkdir()
    (target / "ckptlib.pending").write_text("{}")
    (target / "__3_0.distcp").write_bytes(b"partial")
    ckptlib.save(target, {"w": torch.ones(2)})
    assert sorted(os.listdir(target)) == [".metadata", "__0_0.distcp", "ckptlib.json"]


@pytest.mark.parametrize(
    "state, message",
    [
        pytest.param([1, 2], "state must be a mapping", id="not-a-mapping"),
        pytest.param({"": 1}, "state key '' must be a non-empty string", id="empty-key"),
        pytest.param({1: 1}, "state key 1 must be a non-empty string", id="int-key"),
        pytest.param(
            {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
            "state keys collide: two entries are both saved under the key 'a.b'",
            id="dotted-key-collides",
        ),
        pytest.param(
            {"x": {"m": nn.Linear(1, 1)}},
            "put modules, optimizers and RankLocal objects at the top level",
            id="nested-module",
        ),
    ],
)
def test_bad_state_is_a_state_error(tmp_path, state, message):
    with pytest.raises(StateError, match=message):
        ckptlib.save(tmp_path / "c", state)
    assert not (tmp_path / "c").exists()


def test_optimizer_without_its_module(tmp_path):
    _, opt = _trained()
    with pytest.raises(StateError, match="optimizer state\\['optim'\\] has parameters that belong to no nn.Module"):
        ckptlib.save(tmp_path / "c", {"optim": opt})
    with pytest.raises(StateError) as caught:
        ckptlib.save(tmp_path / "c", {"other": _model(1), "optim": opt})
    assert str(caught.value) == (
        "optimizer state['optim'] has parameters that belong to no nn.Module in the state; put the model it "
        "optimizes in the same state mapping (modules found: ['other'])"
    )
    with pytest.raises(StateError, match=r"\(modules found: none\)$"):
        ckptlib.save(tmp_path / "c", {"optim": opt})


def test_metadata_must_be_json(tmp_path):
    with pytest.raises(StateError, match="metadata must be JSON-serializable"):
        ckptlib.save(tmp_path / "c", {"w": torch.ones(1)}, metadata={"bad": object()})


# ---------------------------------------------------------------- across ranks


def _save_then_load_missing(uri: str):
    rank = dist.get_rank()
    ckptlib.save(uri, {"w": torch.full((4,), float(rank))})
    ckptlib.load(uri, {"w": torch.zeros(4), "absent": torch.zeros(1)})


def test_missing_keys_raise_on_every_rank(tmp_path, dist_run):
    results = dist_run(3, _save_then_load_missing, str(tmp_path / "c"), return_exceptions=True)
    assert [type(r) for r in results] == [MissingKeysError] * 3
    assert all(r.keys == ["absent"] for r in results)


def _load_nonexistent(uri: str):
    ckptlib.load(uri, {"w": torch.zeros(1)})


def test_nonexistent_raises_on_every_rank(tmp_path, dist_run):
    results = dist_run(2, _load_nonexistent, str(tmp_path / "missing"), return_exceptions=True)
    assert [type(r) for r in results] == [CheckpointNotFoundError] * 2
    assert all("the path does not exist" in str(r) for r in results)


def _shape_mismatch_on_rank1(uri: str):
    rank = dist.get_rank()
    ckptlib.save(uri, {"w": torch.ones(4)})
    ckptlib.load(uri, {"w": torch.zeros(4 if rank != 1 else 5)})


def test_one_rank_shape_mismatch_raises_everywhere(tmp_path, dist_run):
    results = dist_run(3, _shape_mismatch_on_rank1, str(tmp_path / "c"), return_exceptions=True)
    assert [type(r) for r in results] == [ShapeMismatchError] * 3
    assert all("shape (5,) in the state, (4,) in the checkpoint" in str(r) for r in results)
    assert all(r.rank == 1 for r in results)


def _save_replicated_and_sharded(uri: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    ckptlib.save(uri, {"dt": distribute_tensor(full, mesh, [Shard(1)]), "rep": full * 2, "n": 3})
    return sorted(os.listdir(uri))


def _plain_dcp_load(uri: str):
    target = {"dt": torch.zeros(6, 5), "rep": torch.zeros(6, 5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=uri)
    return target


def test_multi_rank_checkpoint_files_and_plain_dcp(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    listings = dist_run(4, _save_replicated_and_sharded, uri)
    expected_files = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "ckptlib.json"]
    assert listings == [expected_files] * 4
    manifest = json.loads((tmp_path / "c" / "ckptlib.json").read_text())
    assert manifest["world_size"] == 4 and sorted(manifest["files"]) == expected_files[:5]
    full = torch.arange(30, dtype=torch.float32).reshape(6, 5)
    for target in dist_run(2, _plain_dcp_load, uri):
        assert torch.equal(target["dt"], full) and torch.equal(target["rep"], full * 2)
    single = _plain_dcp_load(uri)
    assert torch.equal(single["dt"], full)


def _save_only_replicated(uri: str):
    """Two replicated values on three ranks: DCP writes each once, so one rank's plan is empty."""
    result = ckptlib.save(uri, {"rep": torch.arange(12, dtype=torch.float32), "n": 5}, step=3)
    return result.total_bytes, result.step, result.world_size


def test_ranks_with_nothing_to_save_still_commit(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    results = dist_run(3, _save_only_replicated, uri)
    manifest = json.loads((tmp_path / "c" / "ckptlib.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    shards = [manifest["files"][f"__{r}_0.distcp"] for r in range(3)]
    assert [len(s["items"]) for s in shards].count(0) == 1
    assert {"size": 0, "crc32": 0, "items": []} in shards
    total = sum(f["size"] for f in manifest["files"].values())
    assert total == sum(os.path.getsize(tmp_path / "c" / n) for n in manifest["files"])
    assert results == [(total, 3, 3)] * 3  # every rank reports the committed size
    target = {"rep": torch.zeros(12), "n": 0}
    ckptlib.load(uri, target)
    assert torch.equal(target["rep"], torch.arange(12, dtype=torch.float32)) and target["n"] == 5


def _save_twice(uri: str):
    ckptlib.save(uri, {"w": torch.full((4,), 1.0)})
    ckptlib.save(uri, {"w": torch.full((4,), 2.0)})


def test_existing_checkpoint_refused_on_every_rank_before_any_write(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    results = dist_run(3, _save_twice, uri, return_exceptions=True)
    assert [type(r) for r in results] == [CheckpointExistsError] * 3
    # Decided once on rank 0 for everyone: the same message, no per-rank prefix.
    assert {str(r) for r in results} == {f"{uri} already holds a committed checkpoint (pass overwrite=True)"}
    assert {r.rank for r in results} == {0}
    loaded = {"w": torch.zeros(4)}
    ckptlib.load(uri, loaded)
    assert torch.equal(loaded["w"], torch.ones(4))


class _Store(MutableMapping):
    """A state mapping that is not a dict (a user's own container)."""

    def __init__(self, **items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __setitem__(self, key, value):
        self._items[key] = value

    def __delitem__(self, key):
        del self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_plain_values_load_into_any_mutable_mapping_and_not_into_a_read_only_one(tmp_path):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(2), "epoch": 7})
    state = _Store(w=torch.zeros(2), epoch=0)
    ckptlib.load(tmp_path / "c", state)
    assert state["epoch"] == 7 and state["w"].tolist() == [1.0, 1.0]
    frozen = types.MappingProxyType({"w": torch.zeros(2), "epoch": 0})
    with pytest.raises(StateError) as caught:
        ckptlib.load(tmp_path / "c", frozen)
    assert str(caught.value) == "cannot store loaded value for 'epoch': the state mapping is read-only"
    assert frozen["epoch"] == 0


def test_the_public_names_import_on_first_use_and_all_resolve():
    """`import ckptlib` imports no torch (its errors are there at once); every name of
    `__all__` resolves to the object its defining module holds, and `dir()` lists it."""
    import subprocess
    import sys

    code = (
        "import sys, ckptlib\n"
        "assert 'torch' not in sys.modules, 'import ckptlib imported torch'\n"
        "assert issubclass(ckptlib.RemoteUnavailableError, ckptlib.StorageError)\n"
        "assert 'torch' not in sys.modules\n"
        "import importlib\n"
        "for name in ckptlib.__all__:\n"
        "    value = getattr(ckptlib, name)\n"
        "    assert name in dir(ckptlib), name\n"
        "    module = ckptlib._ON_USE.get(name)\n"
        "    if module and name != 'dcp':\n"
        "        assert getattr(importlib.import_module(module), name) is value, name\n"
        "try:\n"
        "    ckptlib.load_result\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "module 'ckptlib' has no attribute 'load_result'"
