"""Values ckptlib cannot store are refused by name, on save before anything is written and on
load before anything is read: a metric too large for a float; a sparse, nested, quantized,
meta or sub-byte (int4, uint4, bits8) tensor in the state; such a tensor in a torch.save file.

Before: the metric raised a raw OverflowError; the tensors raised the bare CheckpointError
"rank 0: RuntimeError: ..." with torch's text and no key (a nested tensor in a load target a
raw RuntimeError), from the middle of DCP.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, StateError, UnsupportedError


def _maybe(name: str):
    return isinstance(getattr(torch, name, None), torch.dtype)


TENSORS = {
    "sparse-coo": (lambda: torch.eye(3).to_sparse(), "a sparse tensor (layout torch.sparse_coo)"),
    "sparse-csr": (lambda: torch.eye(3).to_sparse_csr(), "a sparse tensor (layout torch.sparse_csr)"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(3), torch.ones(3)]), "a nested tensor"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.ones(3, 3), 0.1, 0, torch.quint8),
        "a quantized tensor (torch.quint8)",
    ),
    "meta": (lambda: torch.empty(3, 3, device="meta"), "a meta tensor, which holds no data"),
}
for _name in ("int4", "uint4", "bits8"):
    if _maybe(_name):
        TENSORS[_name] = (
            lambda n=_name: (
                torch.empty(3, 3, dtype=torch.uint8).view(getattr(torch, n))
                if n == "bits8"
                else torch.empty(9, dtype=getattr(torch, n)).reshape(3, 3)
            ),
            f"a tensor of dtype torch.{_name}, whose elements are not whole bytes",
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(TENSORS))
def test_a_tensor_dcp_cannot_store_is_refused_by_key_on_save(tmp_path, case):
    make, reason = TENSORS[case]
    path = str(tmp_path / "c")
    with pytest.raises(StateError) as info:
        ckptlib.save(path, {"model": {"w": make(), "b": torch.ones(2)}, "step": 1})
    assert str(info.value).startswith(f"state value model.w is {reason}"), str(info.value)
    assert not os.path.exists(path)
    root = tmp_path / "run"
    with pytest.raises(StateError, match=f"state value model.w is {reason[:12]}"):
        CheckpointManager(root).save(3, {"model": {"w": make()}})
    assert not any(n.startswith("step_") for n in os.listdir(root)) if root.exists() else True


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(TENSORS))
def test_a_tensor_dcp_cannot_store_is_refused_by_key_on_load(tmp_path, case):
    make, reason = TENSORS[case]
    path = str(tmp_path / "c")
    ckptlib.save(path, {"model": {"w": torch.eye(3), "b": torch.ones(2)}})
    b = torch.zeros(2)
    with pytest.raises(StateError) as info:
        ckptlib.load(path, {"model": {"w": make(), "b": b}}, cast=True)
    assert f"model.w is {reason}" in str(info.value) and info.value.path == path, str(info.value)
    assert torch.equal(b, torch.zeros(2))  # nothing was read into the state


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", ["sparse-coo", "nested", "quantized", "meta"])
def test_such_a_tensor_in_a_torch_save_file_is_refused_by_key(tmp_path, case):
    make, reason = TENSORS[case]
    path = str(tmp_path / "weights.pt")
    torch.save({"w": make(), "b": torch.ones(2)}, path)
    with pytest.raises(UnsupportedError) as info:
        ckptlib.load(path, {"model": {"w": torch.zeros(3, 3), "b": torch.zeros(2)}})
    assert str(info.value).startswith(f"{path}: model.w is a "), str(info.value)
    assert info.value.path == path


@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_a_metric_too_large_for_a_float_is_refused_by_name(tmp_path, value):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    with pytest.raises(StateError, match=r"metric 'loss' is an int of \d+ bits, too large for a float"):
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": value})
    with pytest.raises(StateError, match="metric 'loss' is an int"):
        ckptlib.save(str(tmp_path / "c"), {"w": torch.ones(2)}, metrics={"loss": value})
    assert mgr.steps() == [] and not os.path.exists(tmp_path / "c")
    mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 10**300})  # large, but a float holds it
    assert mgr.steps() == [1]
