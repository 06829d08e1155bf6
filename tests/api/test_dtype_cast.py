"""Loading into a tensor of another dtype is never silent: without `cast=True` it is a
DtypeMismatchError (a ShapeMismatchError) naming the keys with the saved and requested dtypes,
strict or not; with `cast=True` the values are converted and a CastWarning lists the keys
(lossy conversions marked). Widening needs `cast=True` too: one rule, no exceptions."""

from __future__ import annotations

import warnings

import pytest
import torch

import ckptlib
from ckptlib import CastWarning, DtypeMismatchError, ShapeMismatchError

SAVED = torch.tensor([1.0, -2.5, 3.25, 65504.0, 1e-3, 300.0])

# name -> (saved dtype, requested dtype, lossy)
PAIRS = {
    "fp32-fp16": (torch.float32, torch.float16, True),
    "fp32-bf16": (torch.float32, torch.bfloat16, True),
    "int64-uint8": (torch.int64, torch.uint8, True),
    "fp32-int32": (torch.float32, torch.int32, True),
    "int64-fp32": (torch.int64, torch.float32, True),
    "fp16-fp32": (torch.float16, torch.float32, False),
    "int32-int64": (torch.int32, torch.int64, False),
    "bool-int8": (torch.bool, torch.int8, False),
}


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _save(tmp_path, dtype):
    value = SAVED.to(dtype)
    ckptlib.save(tmp_path / "c", {"model": {"w": value, "b": torch.ones(2)}, "step": 3})
    return value


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_dtype_difference_without_cast_is_an_error(tmp_path, pair, strict):
    saved, requested, lossy = PAIRS[pair]
    _save(tmp_path, saved)
    target = torch.full((6,), 7).to(requested)
    with pytest.raises(DtypeMismatchError) as info:
        ckptlib.load(tmp_path / "c", {"model": {"w": target, "b": torch.zeros(2)}}, strict=strict)
    err = info.value
    assert isinstance(err, ShapeMismatchError)
    assert err.keys == ["model.w"] and err.casts == {"model.w": (saved, requested)}
    assert str(err) == (
        f"{tmp_path / 'c'}: dtypes differ from the checkpoint (model.w saved as {_short(saved)}, requested "
        f"{_short(requested)}{' (lossy)' if lossy else ''}); pass cast=True to convert them"
    )
    assert torch.equal(target, torch.full((6,), 7).to(requested))  # untouched


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_cast_true_converts_and_warns_with_the_keys(tmp_path, pair, strict):
    saved, requested, lossy = PAIRS[pair]
    value = _save(tmp_path, saved)
    target = torch.zeros(6, dtype=requested)
    with pytest.warns(CastWarning) as record:
        ckptlib.load(tmp_path / "c", {"model": {"w": target, "b": torch.zeros(2)}}, strict=strict, cast=True)
    assert torch.equal(target, value.to(requested))
    messages = [str(w.message) for w in record if issubclass(w.category, CastWarning)]
    assert messages == [
        f"{tmp_path / 'c'}: converted to the dtypes the state asked for: model.w saved as {_short(saved)}, "
        f"requested {_short(requested)}{' (lossy)' if lossy else ''}"
    ]


def test_same_dtypes_load_without_warning(tmp_path):
    value = _save(tmp_path, torch.float32)
    target = torch.zeros(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CastWarning)
        ckptlib.load(tmp_path / "c", {"model": {"w": target}}, cast=True)
    assert torch.equal(target, value)


def test_shape_and_dtype_difference_is_a_shape_mismatch_even_with_cast(tmp_path):
    _save(tmp_path, torch.float32)
    with pytest.raises(
        ShapeMismatchError, match=r"model\.w: shape \(5,\) in the state, \(6,\) in the checkpoint"
    ) as info:
        ckptlib.load(tmp_path / "c", {"model": {"w": torch.zeros(5, dtype=torch.float16)}}, cast=True)
    assert not isinstance(info.value, DtypeMismatchError)


@pytest.mark.parametrize("cast", [False, True], ids=["nocast", "cast"])
def test_manager_load_takes_cast(tmp_path, cast):
    with ckptlib.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(5, {"w": torch.arange(4, dtype=torch.int64)})
    target = torch.zeros(4, dtype=torch.uint8)
    mgr = ckptlib.CheckpointManager(tmp_path / "run")
    if not cast:
        with pytest.raises(DtypeMismatchError, match=r"w saved as int64, requested uint8 \(lossy\)"):
            mgr.load({"w": target})
        return
    with pytest.warns(CastWarning, match=r"w saved as int64, requested uint8 \(lossy\)"):
        assert mgr.load({"w": target}, cast=True) == 5
    assert torch.equal(target, torch.arange(4, dtype=torch.uint8))
