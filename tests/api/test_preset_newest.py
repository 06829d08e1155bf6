"""Which checkpoint of a client's save folder a preset reads: the newest, by the client's own
rules, for exact sets of folders (written here with plain `dcp.save`, one process).

- Lightning: `epoch=E-step=S.ckpt`, its version counter `-v1`, `-v2`, ... (newer than the
  unversioned name: Lightning adds one when the name is taken), and `last.ckpt` /
  `last-vN.ckpt` (written at every save with `save_last=True`: its step is meta.pt's
  `global_step`). Newest: the highest step, then epoch, then `last` over a step-named copy of
  the same save, then the highest version.
- Composer: `ep{E}-ba{B}` (the batch is the step; then the epoch), unless `latest-rank0.pt`
  names one.
- torchtitan: `step-N`.

Numbers compare as numbers (step=9 < step=10, -v2 < -v10, ep9 < ep10). Every case is checked
through `Preset.latest`, `ckpt ls --preset --json` (its `latest` and the order of its steps),
and `ckptlib.load(folder, preset=...)`, which reads the chosen folder's value.

Before: folders of one step were ordered by name, so Lightning's `-v1` (a `-` sorts before
`.`) lost to the older unversioned name, `-v10` to `-v9`, Composer's `ep10-ba5` to `ep9-ba5`,
and `last.ckpt` was never considered.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlib
from ckptlib import presets
from ckptlib._torch import dcp_shims
from ckptlib.cli import main as cli_main
from ckptlib.storage import as_storage

# (preset, folders in the order they were written, the newest); a folder "name@S" is a
# Lightning last*.ckpt whose meta.pt says global_step S; "name!" is an unfinished save.
CASES = {
    "lightning-v1-over-unversioned": (
        "lightning",
        ["epoch=0-step=100.ckpt", "epoch=0-step=100-v1.ckpt"],
        "epoch=0-step=100-v1.ckpt",
    ),
    "lightning-v2-over-v1": (
        "lightning",
        ["epoch=0-step=100.ckpt", "epoch=0-step=100-v1.ckpt", "epoch=0-step=100-v2.ckpt"],
        "epoch=0-step=100-v2.ckpt",
    ),
    "lightning-v10-over-v9": (
        "lightning",
        ["epoch=0-step=100-v9.ckpt", "epoch=0-step=100-v10.ckpt"],
        "epoch=0-step=100-v10.ckpt",
    ),
    "lightning-step10-over-step9": (
        "lightning",
        ["epoch=0-step=9.ckpt", "epoch=0-step=10.ckpt"],
        "epoch=0-step=10.ckpt",
    ),
    "lightning-step-over-version": (
        "lightning",
        ["epoch=0-step=9-v1.ckpt", "epoch=0-step=10.ckpt"],
        "epoch=0-step=10.ckpt",
    ),
    "lightning-epoch10-over-epoch9": (
        "lightning",
        ["epoch=9-step=100.ckpt", "epoch=10-step=100.ckpt"],
        "epoch=10-step=100.ckpt",
    ),
    "lightning-prefixed-names": (
        "lightning",
        ["model-epoch=0-step=2.ckpt", "model-epoch=0-step=2-v1.ckpt"],
        "model-epoch=0-step=2-v1.ckpt",
    ),
    "lightning-last-newer": ("lightning", ["epoch=0-step=100.ckpt", "last.ckpt@150"], "last.ckpt"),
    "lightning-last-same-save": ("lightning", ["epoch=0-step=100.ckpt", "last.ckpt@100"], "last.ckpt"),
    "lightning-last-older": ("lightning", ["last.ckpt@150", "epoch=0-step=200.ckpt"], "epoch=0-step=200.ckpt"),
    "lightning-last-v1": ("lightning", ["last.ckpt@100", "last-v1.ckpt@100"], "last-v1.ckpt"),
    "lightning-unfinished-newest": (
        "lightning",
        ["epoch=0-step=9.ckpt", "epoch=0-step=10.ckpt!", "epoch=0-step=9-v1.ckpt!"],
        "epoch=0-step=9.ckpt",
    ),
    "composer-ba10-over-ba9": ("composer", ["ep0-ba9", "ep0-ba10"], "ep0-ba10"),
    "composer-ep1-over-ep0": ("composer", ["ep0-ba10", "ep1-ba10"], "ep1-ba10"),
    "composer-ep10-over-ep9": ("composer", ["ep9-ba10", "ep10-ba10"], "ep10-ba10"),
    "composer-unfinished-newest": ("composer", ["ep0-ba9", "ep0-ba10!"], "ep0-ba9"),
    "torchtitan-step10-over-step9": ("torchtitan", ["step-9", "step-10"], "step-10"),
    "torchtitan-step100": ("torchtitan", ["step-10", "step-100", "step-99"], "step-100"),
    "torchtitan-unfinished-newest": ("torchtitan", ["step-9", "step-10!"], "step-9"),
}
KEYS = {"lightning": "state_dict", "composer": "state.model", "torchtitan": ""}


def _write(root: str, preset: str, names: list[str]) -> dict[str, float]:
    """Each folder holds w = its position; returns name -> w."""
    values = {}
    for i, spec in enumerate(names):
        name, _, meta_step = spec.rstrip("!").partition("@")
        path = os.path.join(root, name)
        w = torch.full((3,), float(i))
        if preset == "composer":
            state = {"state": {"model": {"w": w}}}
        elif preset == "lightning":
            state = {"state_dict": {"w": w}}
        else:
            state = {"w": w}
        dcp.save(state, checkpoint_id=path, no_dist=True)
        if spec.endswith("!"):
            os.remove(os.path.join(path, ".metadata"))  # shards without metadata: a save that never finished
        if preset == "lightning":
            step = int(meta_step) if meta_step else int(name.split("step=")[1].split("-")[0].split(".")[0])
            torch.save({"epoch": 0, "global_step": step}, os.path.join(path, "meta.pt"))
        values[name] = float(i)
    return values


@pytest.mark.parametrize("case", list(CASES))
def test_the_newest_folder_is_read(case, tmp_path, capsys):
    preset, names, newest = CASES[case]
    root = str(tmp_path / "run")
    os.makedirs(root)
    values = _write(root, preset, names)
    assert presets.get(preset).latest(as_storage(root)) == newest
    assert cli_main(["ls", root, "--preset", preset, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["latest"] == newest
    done = [s["name"] for s in listing["steps"] if s["state"] == "dcp"]
    assert done[-1] == newest and [s["name"] for s in listing["steps"] if s["latest"]] == [newest]
    state = {"model": {"w": torch.zeros(3)}}
    result = ckptlib.load(root, state, preset=preset)
    assert os.path.basename(result.uri.rstrip("/")) == newest
    assert torch.equal(state["model"]["w"], torch.full((3,), values[newest]))
    assert cli_main(["inspect", root, "--preset", preset]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"checkpoint:    {root}/{newest}"
    assert cli_main(["verify", root, "--preset", preset, "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{root}/{newest}: OK"
    out = str(tmp_path / "converted.pt")
    assert cli_main(["convert", root, out, "--to", "torch", "--preset", preset, "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"converted {root}/{newest} (dcp) -> {out}")
    (converted,) = dcp_shims.flatten_state_dict(torch.load(out, weights_only=True))[0].values()
    assert torch.equal(converted, torch.full((3,), values[newest]))


def test_lightning_listing_orders_every_folder(tmp_path, capsys):
    """`ckpt ls` lists them oldest first by the same rule, last.ckpt at its meta.pt step."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    names = [
        "epoch=0-step=10-v1.ckpt",
        "last.ckpt@15",
        "epoch=1-step=20.ckpt",
        "epoch=0-step=10.ckpt",
        "epoch=0-step=9.ckpt",
        "epoch=0-step=20.ckpt",
        "epoch=0-step=10-v2.ckpt",
    ]
    _write(root, "lightning", names)
    assert cli_main(["ls", root, "--preset", "lightning", "--json"]) == 0
    steps = [(s["step"], s["name"]) for s in json.loads(capsys.readouterr().out)["steps"]]
    assert steps == [
        (9, "epoch=0-step=9.ckpt"),
        (10, "epoch=0-step=10.ckpt"),
        (10, "epoch=0-step=10-v1.ckpt"),
        (10, "epoch=0-step=10-v2.ckpt"),
        (15, "last.ckpt"),
        (20, "epoch=0-step=20.ckpt"),
        (20, "epoch=1-step=20.ckpt"),
    ]


def test_a_composer_pointer_still_wins(tmp_path):
    """Composer's own `latest-rank0.pt` names the checkpoint, even an older one."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    _write(root, "composer", ["ep0-ba9", "ep0-ba10"])
    os.symlink("ep0-ba9", os.path.join(root, "latest-rank0.pt"))
    assert presets.composer.latest(as_storage(root)) == "ep0-ba9"


def test_export_of_a_step_reads_its_newest_folder(tmp_path):
    """`export(folder, step=S, preset=...)` with two folders of step S: the newer one."""
    root = str(tmp_path / "run")
    os.makedirs(root)
    _write(root, "lightning", ["epoch=0-step=100.ckpt", "epoch=0-step=100-v1.ckpt", "epoch=0-step=200.ckpt"])
    result = ckptlib.export(root, str(tmp_path / "out.pt"), format="torch", step=100, preset="lightning")
    assert os.path.basename(result.src.rstrip("/")) == "epoch=0-step=100-v1.ckpt"
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(got) == ["w"] and torch.equal(got["w"], torch.full((3,), 1.0))  # the model alone


@pytest.mark.parametrize("meta", ["missing", "no-step", "needs-unpickling"])
def test_a_last_folder_without_a_readable_step_is_not_chosen(meta, tmp_path):
    root = str(tmp_path / "run")
    os.makedirs(root)
    _write(root, "lightning", ["epoch=0-step=100.ckpt", "last.ckpt@300"])
    path = os.path.join(root, "last.ckpt", "meta.pt")
    if meta == "missing":
        os.remove(path)
    elif meta == "no-step":
        torch.save({"epoch": 0}, path)
    else:
        torch.save({"global_step": 300, "hparams": _Custom()}, path)
    assert [s.name for s in presets.lightning.scan(as_storage(root))] == ["epoch=0-step=100.ckpt"]
    assert presets.lightning.latest(as_storage(root)) == "epoch=0-step=100.ckpt"


class _Custom:
    pass
