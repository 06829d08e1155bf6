"""`ckptlib.presets` (issue 28.3): other tools' checkpoints read as they lay them out, at any
world size, without the real packages (tests/clients/ runs those). Each layout is written here
with plain `dcp.save` exactly as the client writes it (keys, nesting, side files, folders,
objects), at 2 ranks, and loaded through `preset=` at 1 and 3 ranks bit-exactly."""

from __future__ import annotations

import datetime
import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import ckptlib
from ckptlib import presets
from ckptlib.cli import main as cli_main
from ckptlib.errors import StateError, UnsafeCheckpointError
from ckptlib.presets import composer_save
from ckptlib.testing import launch
from ckptlib.testing.matrices.matrix import differences, full_state, setup, train_step

LAYOUTS = ["composer", "lightning", "torchtitan"]
FOLDER = {"composer": "ep0-ba2", "lightning": "epoch=0-step=2.ckpt", "torchtitan": "step-2"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _client_state(layout: str, model, optim) -> dict:
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, optim)
    if layout == "composer":
        timestamp = {"epoch": 0, "batch": 2, "sample": 16, "total_wct": datetime.timedelta(seconds=1.5)}
        return {
            "state": {
                "model": msd,
                "optimizers": {"AdamW": osd},
                "timestamp": {"Timestamp": timestamp},
                "run_name": "tiny-run",
                "rank_zero_seed": 17,
            },
            "rng": composer_save.rng_states(),
        }
    if layout == "lightning":
        return {"state_dict": msd, "optimizer_0": osd}
    flat = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    flat = {k: v for k, v in flat.items() if not k.endswith(".param_names")}
    return {**msd, "optimizer": flat, "train_state": {"step": 2, "ntokens_seen": 64}}


def client_save(root: str, layout: str) -> dict:
    """Train 2 steps and save as the client does (plain DCP, its folder, its side files)."""
    model, optim = setup("fsdp2", "adamw", seed=0)
    for step in range(2):
        train_step(model, optim, step)
    if layout == "torchtitan":  # an older step, which the preset must not pick
        dcp.save(_client_state(layout, model, optim), checkpoint_id=os.path.join(root, "step-1"))
    path = os.path.join(root, FOLDER[layout])
    dcp.save(_client_state(layout, model, optim), checkpoint_id=path)
    if _rank() == 0 and layout == "composer":
        os.symlink(FOLDER[layout], os.path.join(root, "latest-rank0.pt"))
    if _rank() == 0 and layout == "lightning":
        torch.save({"epoch": 0, "global_step": 2, "loops": {"fit_loop": {"epoch_progress": {}}}}, f"{path}/meta.pt")
    if dist.is_initialized():
        dist.barrier()
    return full_state(model, optim)


def preset_load(root: str, layout: str, expected: dict) -> dict:
    model, optim = setup("fsdp2", "adamw", seed=1)
    result = ckptlib.load(root, {"net": model, "opt": optim}, preset=layout)
    return {
        "differences": differences(expected, full_state(model, optim)),
        "uri": os.path.basename(result.uri),
        "step": result.step,
        "metadata": {
            k: v for k, v in result.metadata.items() if k in ("timestamp", "run_name", "epoch", "train_state")
        },
    }


@pytest.fixture(scope="module", params=LAYOUTS)
def client_root(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp(request.param))
    expected = launch(2, client_save, root, request.param, backend=request.config.getoption("ckptlib_backend"))[0]
    return request.param, root, expected


@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"save2-load{n}")
def test_client_checkpoint_loads_bit_exactly_through_its_preset(client_root, dist_run, world_size):
    layout, root, expected = client_root
    for got in dist_run(world_size, preset_load, root, layout, expected):
        assert got["differences"] == []
        assert got["uri"] == FOLDER[layout] and got["step"] == 2
        if layout == "composer":
            timestamp = {"epoch": 0, "batch": 2, "sample": 16, "total_wct": datetime.timedelta(seconds=1.5)}
            assert got["metadata"] == {"timestamp": timestamp, "run_name": "tiny-run"}
        elif layout == "lightning":
            assert got["metadata"] == {"epoch": 0}
        else:
            assert got["metadata"] == {"train_state": {"step": 2, "ntokens_seen": 64}}


def test_ls_finds_a_clients_save_folder(client_root, capsys):
    layout, root, _ = client_root
    assert cli_main(["ls", root, "--json"]) == 0  # found without --preset
    listing = json.loads(capsys.readouterr().out)
    assert listing["preset"] == layout and listing["latest"] == FOLDER[layout]
    steps = [(s["step"], s["name"], s["state"], s["latest"]) for s in listing["steps"]]
    expected = [(2, FOLDER[layout], "dcp", True)]
    if layout == "torchtitan":
        expected.insert(0, (1, "step-1", "dcp", False))
    assert steps == expected
    assert cli_main(["ls", root, "--preset", layout]) == 0
    assert FOLDER[layout] in capsys.readouterr().out
    assert cli_main(["inspect", root, "--preset", layout, "--json"]) == 0  # the save folder's newest checkpoint
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
    assert cli_main(["verify", root, "--preset", layout, "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{root}/{FOLDER[layout]}: OK"


def test_export_model_only_finds_the_clients_model_keys(client_root, tmp_path):
    layout, root, expected = client_root
    result = ckptlib.export(root, str(tmp_path / "hf"), model_only=True, preset=layout)
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(expected["model"])
    assert all(torch.equal(got[k], v) for k, v in expected["model"].items())
    assert result.step is None and os.path.basename(result.src) == FOLDER[layout]


def test_composer_objects_need_no_trusted_with_the_preset_and_nothing_more(client_root, tmp_path, capsys):
    layout, root, _ = client_root
    if layout != "composer":
        pytest.skip("Composer's objects")
    rc = cli_main(["convert", root + "/ep0-ba2", str(tmp_path / "plain"), "--no-progress"])
    assert rc == 1 and "needs arbitrary unpickling (it names the global datetime.timedelta)" in capsys.readouterr().err
    assert cli_main(["convert", root, str(tmp_path / "ok"), "--preset", "composer", "--no-progress"]) == 0
    state = {"state": {"rank_zero_seed": 0, "timestamp": {"Timestamp": {"total_wct": None}}}}
    ckptlib.load(str(tmp_path / "ok"), state, preset="composer")  # the converted copy reads the same way
    assert state["state"] == {
        "rank_zero_seed": 17,
        "timestamp": {"Timestamp": {"total_wct": datetime.timedelta(seconds=1.5)}},
    }
    crafted = str(tmp_path / "crafted")
    dcp.save({"state": {"x": datetime.date(2020, 1, 1)}}, checkpoint_id=crafted)
    with pytest.raises(UnsafeCheckpointError, match="datetime.date"):
        ckptlib.load(crafted, {"state": {"x": None}}, preset="composer")


class FakeComposerState:
    """What composer_save.save needs of Composer's State: timestamp and state_dict()."""

    class _Value:
        def __init__(self, value):
            self.value = value

    def __init__(self, model, optim, batch):
        self.model, self.optim = model, optim
        self.timestamp = type("T", (), {"epoch": self._Value(0), "batch": self._Value(batch)})()

    def state_dict(self):
        ts = {"epoch": 0, "batch": self.timestamp.batch.value, "total_wct": datetime.timedelta(0)}
        return {
            "model": get_model_state_dict(self.model),
            "optimizers": {"AdamW": get_optimizer_state_dict(self.model, self.optim)},
            "timestamp": {"Timestamp": ts},
            "rank_zero_seed": 17,
        }

    def load_state_dict(self, state_dict):
        raise AssertionError("not loaded through the State")


def composer_save_side(root: str) -> dict:
    random.seed(dist.get_rank())
    np.random.seed(dist.get_rank())
    model, optim = setup("fsdp2", "adamw", seed=0)
    for step in range(2):
        train_step(model, optim, step)
    result = composer_save.save(root, FakeComposerState(model, optim, 2))
    assert os.readlink(os.path.join(root, "latest-rank0.pt")) == "ep0-ba2"  # every rank returns after the pointer
    return {"expected": full_state(model, optim), "step": result.step, "python": random.getstate()}


def test_composer_save_writes_composers_layout_and_pointer(tmp_path, dist_run):
    root = str(tmp_path / "run")
    saved = dist_run(2, composer_save_side, root)
    assert {s["step"] for s in saved} == {2}
    assert sorted(os.listdir(root)) == ["ep0-ba2", "latest-rank0.pt"]
    assert os.readlink(os.path.join(root, "latest-rank0.pt")) == "ep0-ba2"
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(os.path.join(root, "ep0-ba2")).read_metadata()
    for r in (0, 1):
        for name in ("python", "numpy", "torch"):
            assert metadata.planner_data[f"rng.{r}.{name}"] == ("rng", r, name)  # what Composer's loader reads
    assert metadata.planner_data["state.callbacks.CheckpointSaver.all_saved_checkpoints_to_timestamp"][:3] == (
        "state",
        "callbacks",
        "CheckpointSaver",
    )
    assert "state.timestamp.Timestamp.batch" in metadata.state_dict_metadata
    for got in dist_run(3, preset_load, root, "composer", saved[0]["expected"]):
        assert got["differences"] == [] and got["step"] == 2


def test_an_unknown_preset_is_named():
    with pytest.raises(StateError, match="unknown preset 'mosaic'; the presets are composer, lightning, torchtitan"):
        presets.get("mosaic")
