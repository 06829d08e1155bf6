"""The adapters of other tools' checkpointers without the tools (issue 48.2): references resolve
to instances without importing torchtitan, Lightning or Accelerate; what each promises to carry
follows the state; a state without exactly one model is refused by name. The adapters against
the real packages: tests/clients/test_checkpointer_adapters.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import ckptlib
from ckptlib.testing.checkpointers import ADAPTERS, CheckpointerError, resolve

PACKAGES = ("torchtitan", "lightning", "accelerate")


def test_resolving_every_adapter_imports_none_of_the_tools():
    code = (
        "import json, sys\n"
        "import ckptlib.testing\n"
        "from ckptlib.testing.checkpointers import resolve\n"
        f"made = {{n: type(resolve('ckptlib.testing.checkpointers:' + n)).__name__ for n in {PACKAGES!r}}}\n"
        f"print(json.dumps([made, sorted(m for m in {PACKAGES!r} if m in sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    made, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert made == {
        "torchtitan": "TorchtitanCheckpointer",
        "lightning": "LightningCheckpointer",
        "accelerate": "AccelerateCheckpointer",
    }
    assert imported == []


def _state() -> dict:
    model = nn.Linear(2, 2)
    optim = torch.optim.AdamW(model.parameters())
    return {
        "model": model,
        "optim": optim,
        "sched": torch.optim.lr_scheduler.StepLR(optim, step_size=1),
        "rng": ckptlib.RNGState(),
        "step": 0,
        "epoch": 1,
    }


@pytest.mark.parametrize(
    "name, carried",
    [
        ("torchtitan", ["epoch", "model", "optim", "sched", "step"]),
        ("lightning", ["epoch", "model", "optim", "step"]),
        ("accelerate", ["epoch", "model", "optim", "sched", "step"]),
    ],
    ids=["torchtitan", "lightning", "accelerate"],
)
def test_each_adapter_promises_what_its_package_restores(name, carried):
    checkpointer = resolve(f"ckptlib.testing.checkpointers:{name}")
    assert checkpointer.name == name
    state = _state()
    assert sorted(checkpointer.carries(state)) == carried  # never the per-rank "rng"
    # `name in carries`, as the harness asks it: every name until the adapter is handed a state,
    # then that state's promise
    assert all(name in checkpointer.carries for name in state)
    checkpointer.carries.note(state)
    assert [name for name in state if name in checkpointer.carries] == [n for n in state if n in carried]
    assert hasattr(checkpointer, "async_save") is (name == "torchtitan")  # the only one with a background save


@pytest.mark.parametrize(
    "name, folder",
    [("torchtitan", "/r/checkpoint"), ("lightning", "/r"), ("accelerate", "/r/checkpoints")],
    ids=["torchtitan", "lightning", "accelerate"],
)
def test_each_adapter_names_the_folder_its_package_writes_under(name, folder, tmp_path):
    checkpointer = resolve(f"ckptlib.testing.checkpointers:{name}")
    assert checkpointer.where("/r") == folder
    if name != "torchtitan":  # the newest step as the package would resume it, from file names alone
        assert checkpointer.newest(str(tmp_path / "missing")) is None
        for step, complete in ((3, True), (12, True), (20, False)):
            if name == "lightning":
                (tmp_path / f"step={step}.ckpt").mkdir()
                if complete:
                    (tmp_path / f"step={step}.ckpt" / "meta.pt").write_bytes(b"")
            elif complete:
                (tmp_path / "checkpoints" / f"checkpoint_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / "notes").mkdir(parents=True)
        assert checkpointer.newest(str(tmp_path)) == 12


@pytest.mark.parametrize("name", PACKAGES)
@pytest.mark.parametrize("models", [0, 2], ids=["no-model", "two-models"])
def test_a_state_without_exactly_one_model_is_refused_naming_the_adapter(name, models):
    state = {f"m{i}": nn.Linear(2, 2) for i in range(models)}
    state["step"] = 0
    found = sorted(k for k in state if k != "step") or "none"
    with pytest.raises(CheckpointerError) as caught:
        resolve(f"ckptlib.testing.checkpointers:{name}").save("/nonexistent-root", 1, state)
    assert str(caught.value) == f"{name}: the state must hold exactly one nn.Module (the model), found {found}"


def test_an_unknown_adapter_name_is_an_attribute_error():
    import ckptlib.testing.checkpointers as checkpointers

    assert sorted(ADAPTERS) == sorted(PACKAGES)
    with pytest.raises(CheckpointerError, match="has no 'deepspeed'"):
        resolve("ckptlib.testing.checkpointers:deepspeed")
    with pytest.raises(AttributeError, match="has no attribute 'deepspeed'"):
        checkpointers.deepspeed  # noqa: B018
