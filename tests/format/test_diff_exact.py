"""`ckpt diff` never calls different values equal, whichever side is A: non-finite values by
rule (the same infinity is equal, NaN equals NaN unless `equal_nan=False`, a finite value
against a non-finite one always differs), integers as integers (int64/uint64 past 2^53
included), every dtype exact at atol=0, rtol=0, -0.0 equal to 0.0 unless `bitwise=True`, a
tolerance symmetric in A and B, non-tensor entries of different types different.

Before: a finite value against inf (and inf against -inf) was equal one way round (the
tolerance atol + rtol*|b| was NaN and `gap > NaN` is false), int64/uint64 values past 2^53
were widened to float64 and compared equal, and the relative tolerance took |b| only.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlib import cli
from ckptlib.offline.diff import DiffError, diff_checkpoints

INF, NAN = math.inf, math.nan
FLOATS = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
EVERY = FLOATS + INTS + COMPLEX + [torch.bool]
SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _files(tmp_path, a: dict, b: dict) -> tuple[str, str]:
    pa, pb = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    torch.save(a, pa)
    torch.save(b, pb)
    return pa, pb


def both_ways(tmp_path, a: torch.Tensor, b: torch.Tensor, **kw):
    """diff(A, B) and diff(B, A) of two torch.save files holding {"x": a} and {"x": b}."""
    pa, pb = _files(tmp_path, {"x": a}, {"x": b})
    return diff_checkpoints(pa, pb, **kw), diff_checkpoints(pb, pa, **kw)


def verdicts(tmp_path, a, b, dtype=torch.float32, **kw) -> tuple[bool, bool]:
    ab, ba = both_ways(tmp_path, torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype), **kw)
    return ab.equal, ba.equal


@pytest.mark.parametrize(
    "a,b",
    [([1.0], [INF]), ([1.0], [-INF]), ([INF], [-INF]), ([0.0], [NAN]), ([INF], [NAN]), ([3.0e38], [INF])],
    ids=["finite-inf", "finite-neginf", "inf-neginf", "zero-nan", "inf-nan", "max-inf"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_finite_against_non_finite_differs_both_ways(tmp_path, a, b, dtype):
    if dtype == torch.bfloat16 and a == [3.0e38]:
        a = [torch.finfo(torch.bfloat16).max]
    ab, ba = both_ways(tmp_path, torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype))
    for report in (ab, ba):
        (t,) = report.tensors
        assert (report.equal, t.mismatched, t.bit_identical, t.max_abs_diff, t.worst_index) == (
            False,
            1,
            False,
            INF,
            [0],
        )
    assert ab.tensors[0].worst_a == ba.tensors[0].worst_b


@pytest.mark.parametrize("rtol,atol", [(0.0, 0.0), (0.5, 0.0), (0.0, 1e300), (1e9, 1e9)])
def test_no_tolerance_covers_a_non_finite_difference(tmp_path, rtol, atol):
    a = torch.tensor([1.0, INF, NAN, 5.0])
    b = torch.tensor([INF, -INF, 2.0, 5.0])
    ab, ba = both_ways(tmp_path, a, b, rtol=rtol, atol=atol)
    assert [r.tensors[0].mismatched for r in (ab, ba)] == [3, 3]


def test_the_same_non_finite_value_is_equal(tmp_path):
    a = torch.tensor([INF, -INF, NAN, 1.0])
    ab, ba = both_ways(tmp_path, a, a.clone())
    assert ab.equal and ba.equal and ab.tensors[0].bit_identical
    # A NaN of other bits is still NaN: numerically equal, not bit-identical.
    other = a.clone()
    other.view(torch.int32)[2] ^= 1
    assert math.isnan(other[2].item())
    ab, ba = both_ways(tmp_path, a, other)
    assert (ab.equal, ba.equal, ab.tensors[0].bit_identical) == (True, True, False)
    ab, ba = both_ways(tmp_path, a, other, bitwise=True)
    assert (ab.equal, ba.equal, ab.tensors[0].mismatched) == (False, False, 1)


def test_equal_nan_false_makes_nan_differ_from_itself(tmp_path):
    a = torch.tensor([NAN, 1.0, NAN])
    ab, ba = both_ways(tmp_path, a, a.clone(), equal_nan=False)
    assert (ab.equal, ba.equal, ab.tensors[0].mismatched, ab.tensors[0].bit_identical) == (False, False, 2, True)
    assert ab.to_json()["equal_nan"] is False
    assert (ab.summary()["bit_identical"], ab.summary()["different"]) == (0, 1)  # a partition of the tensors
    complex_nan = torch.tensor([complex(1.0, NAN)])
    assert both_ways(tmp_path, complex_nan, complex_nan.clone())[0].equal
    assert not both_ways(tmp_path, complex_nan, complex_nan.clone(), equal_nan=False)[0].equal


def test_negative_zero_equals_zero_unless_bitwise(tmp_path):
    ab, ba = both_ways(tmp_path, torch.tensor([-0.0, 1.0]), torch.tensor([0.0, 1.0]))
    (t,) = ab.tensors
    assert (ab.equal, ba.equal, t.bit_identical, t.mismatched, t.max_abs_diff) == (True, True, False, 0, 0.0)
    assert ab.summary()["within_tolerance"] == 1
    ab, ba = both_ways(tmp_path, torch.tensor([-0.0, 1.0]), torch.tensor([0.0, 1.0]), bitwise=True)
    assert (ab.equal, ba.equal, ab.tensors[0].mismatched, ab.tensors[0].worst_index) == (False, False, 1, [0])
    assert ab.to_json()["bitwise"] is True


@pytest.mark.parametrize(
    "a,b,dtype,gap",
    [
        (2**53, 2**53 + 1, torch.int64, 1),
        (2**62 + 1, 2**62, torch.int64, 1),
        (-(2**63), 2**63 - 1, torch.int64, 2**64 - 1),
        (2**63, 2**63 + 1, torch.uint64, 1),
        (0, 2**64 - 1, torch.uint64, 2**64 - 1),
        (2**32 - 1, 2**32 - 2, torch.uint32, 1),
        (-(2**31), 2**31 - 1, torch.int32, 2**32 - 1),
    ],
    ids=["int64-2^53", "int64-2^62", "int64-extremes", "uint64-2^63", "uint64-extremes", "uint32", "int32-extremes"],
)
def test_integers_compare_as_integers(tmp_path, capsys, a, b, dtype, gap):
    ab, ba = both_ways(tmp_path, torch.tensor([a, 7], dtype=dtype), torch.tensor([b, 7], dtype=dtype))
    for report, (x, y) in ((ab, (a, b)), (ba, (b, a))):
        (t,) = report.tensors
        assert (report.equal, t.mismatched, t.max_abs_diff, t.worst_index, t.worst_a, t.worst_b) == (
            False,
            1,
            gap,
            [0],
            x,
            y,
        )
        assert type(t.max_abs_diff) is int
    pa, pb = _files(tmp_path, {"x": torch.tensor([a, 7], dtype=dtype)}, {"x": torch.tensor([b, 7], dtype=dtype)})
    assert cli.main(["diff", pa, pb]) == 1
    assert f"max abs diff {gap} at [0] (A {a}, B {b})" in capsys.readouterr().out
    assert both_ways(tmp_path, torch.tensor([a], dtype=dtype), torch.tensor([a], dtype=dtype))[0].equal


def test_an_integer_tolerance_is_exact_past_2_53(tmp_path):
    """float64 rounds 2^60 + 3 to 2^60: a widened gap would be 0."""
    a, b = torch.tensor([2**60], dtype=torch.int64), torch.tensor([2**60 + 3], dtype=torch.int64)
    assert [r.equal for r in both_ways(tmp_path, a, b, atol=2)] == [False, False]
    assert [r.equal for r in both_ways(tmp_path, a, b, atol=3)] == [True, True]
    big = torch.tensor([2**64 - 1], dtype=torch.uint64)
    assert [r.equal for r in both_ways(tmp_path, big, torch.tensor([0], dtype=torch.uint64), atol=1e300)] == [
        True,
        True,
    ]


def test_relative_tolerance_is_symmetric(tmp_path):
    """|a - b| <= atol + rtol * max(|a|, |b|): 1 against 2 at rtol 0.5 is equal both ways."""
    assert verdicts(tmp_path, [1.0], [2.0], rtol=0.5) == (True, True)
    assert verdicts(tmp_path, [1.0], [2.0], rtol=0.49) == (False, False)
    ab, ba = both_ways(tmp_path, torch.tensor([1.0]), torch.tensor([4.0]))
    assert ab.tensors[0].max_rel_diff == ba.tensors[0].max_rel_diff == 0.75


def _one_step(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of `dtype` equal but in one element, which differs by the least a value can."""
    a = torch.ones(3, 4, dtype=torch.float32).to(dtype)
    b = a.clone()
    if dtype == torch.bool:
        b[1, 2] = False
    elif dtype.is_complex:
        b[1, 2] = complex(1.0, torch.finfo(dtype).eps if dtype == torch.complex128 else 2.0**-149)
    elif dtype.is_floating_point:
        b.view(SAME_SIZE_INT[b.element_size()])[1, 2] += 1  # the next representable value above 1
    else:
        b[1, 2] = 2
    return a, b


@pytest.mark.parametrize("dtype", EVERY, ids=str)
def test_every_dtype_is_exact_at_zero_tolerance(tmp_path, dtype):
    a, b = _one_step(dtype)
    assert not torch.equal(a, b)
    ab, ba = both_ways(tmp_path, a, b)
    for report in (ab, ba):
        (t,) = report.tensors
        assert (report.equal, t.mismatched, t.worst_index, t.dtype_a) == (False, 1, [1, 2], str(dtype))
        assert t.max_abs_diff > 0
    same = both_ways(tmp_path, a, a.clone())[0]
    assert same.equal and same.tensors[0].bit_identical


def test_shape_and_dtype_mismatches_are_reported_both_ways(tmp_path):
    a = {"w": torch.ones(3, 2), "v": torch.zeros(4), "i": torch.tensor([2**53 + 1])}
    b = {"w": torch.ones(2, 3), "v": torch.zeros(4, dtype=torch.float64), "i": torch.tensor([2**53 + 1.0])}
    pa, pb = _files(tmp_path, a, b)
    ab, ba = diff_checkpoints(pa, pb), diff_checkpoints(pb, pa)
    assert not ab.equal and not ba.equal
    assert ab.mismatched == [
        {
            "key": "model.w",
            "a": {"shape": [3, 2], "dtype": "torch.float32"},
            "b": {"shape": [2, 3], "dtype": "torch.float32"},
        }
    ]
    assert ba.mismatched == [{"key": "model.w", "a": ab.mismatched[0]["b"], "b": ab.mismatched[0]["a"]}]
    for report, swap in ((ab, False), (ba, True)):
        by_key = {t.key: t for t in report.tensors}
        dtypes = ["torch.float32", "torch.float64"]
        assert [by_key["model.v"].dtype_a, by_key["model.v"].dtype_b] == (dtypes[::-1] if swap else dtypes)
        assert not by_key["model.v"].within_tolerance and by_key["model.v"].mismatched == 0
        # int64 2^53 + 1 against float32's nearest value: different dtypes, and different values
        assert not by_key["model.i"].within_tolerance and by_key["model.i"].mismatched == 1
    assert ab.summary()["different"] == ba.summary()["different"] == 2


def test_objects_of_different_types_or_values_differ(tmp_path):
    a = {"lr": 1, "flag": True, "x": torch.ones(1), "nan": NAN, "z": 0.0, "name": "run", "sched": [1, 2.0]}
    b = {"lr": 1.0, "flag": 1, "x": torch.ones(1), "nan": NAN, "z": -0.0, "name": "run", "sched": [1, 2]}
    pa, pb = _files(tmp_path, a, b)
    for report in (diff_checkpoints(pa, pb), diff_checkpoints(pb, pa)):
        equal = {o["key"]: o["equal"] for o in report.objects}
        assert equal == {
            "lr": False,
            "flag": False,
            "nan": True,
            "z": True,
            "name": True,
            "sched": False,
        }
    assert {o["key"]: o["equal"] for o in diff_checkpoints(pa, pb, equal_nan=False).objects}["nan"] is False
    assert {o["key"]: o["equal"] for o in diff_checkpoints(pa, pb, bitwise=True).objects}["z"] is False


def test_cli_flags_and_json(tmp_path, capsys):
    pa, pb = _files(tmp_path, {"x": torch.tensor([NAN, -0.0])}, {"x": torch.tensor([NAN, 0.0])})
    assert cli.main(["diff", pa, pb]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "EQUAL"
    assert cli.main(["diff", pa, pb, "--bitwise"]) == 1
    assert cli.main(["diff", pa, pb, "--no-equal-nan"]) == 1
    out = capsys.readouterr().out
    assert "differs: model.x: 1 of 2 elements beyond tolerance; max abs diff inf at [0] (A 'nan', B 'nan')" in out
    assert cli.main(["diff", pa, pb, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["equal"], doc["equal_nan"], doc["bitwise"], doc["tensors"][0]["bit_identical"]) == (
        True,
        True,
        False,
        False,
    )
    with pytest.raises(DiffError, match="bitwise compares bits: atol and rtol must be 0"):
        diff_checkpoints(pa, pb, bitwise=True, atol=1.0)
    assert cli.main(["diff", pa, pb, "--bitwise", "--rtol", "0.1"]) == 2
    assert "bitwise compares bits: atol and rtol must be 0" in capsys.readouterr().err


# Property: one element changed to a value that is numerically different (by the rule, from
# Python's own float/int/complex comparison) makes A and B differ both ways; A equals itself.


def _numerically_same(x, y) -> bool:
    if isinstance(x, complex):
        return _numerically_same(x.real, y.real) and _numerically_same(x.imag, y.imag)
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)
    return x == y


def _unravel(flat: int, shape) -> list[int]:
    out = []
    for size in reversed(shape):
        out.insert(0, flat % size)
        flat //= size
    return out


def _raw(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.tensor(list(data[: math.prod(shape)]), dtype=torch.uint8).remainder(2).bool().reshape(shape)
    n = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def _specials(dtype: torch.dtype) -> list:
    if dtype == torch.bool:
        return [True, False]
    if dtype.is_complex:
        return [complex(INF, 0), complex(0, -INF), complex(NAN, 1), complex(-0.0, 0.0), complex(0.0, 1.0)]
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return [INF, -INF, NAN, -0.0, 0.0, info.max, info.min, info.tiny, info.eps, 1.0]
    info = torch.iinfo(dtype)
    return [info.min, info.max, info.min + 1, info.max - 1, 0, 1]


@st.composite
def one_element_apart(draw):
    dtype = draw(st.sampled_from(EVERY))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    data = draw(st.binary(min_size=16 * max(1, math.prod(shape)), max_size=16 * max(1, math.prod(shape))))
    a = _raw(dtype, shape, data)
    flat = a.reshape(-1)
    index = draw(st.integers(0, flat.numel() - 1))
    old = flat[index].item()
    new_from = st.sampled_from(_specials(dtype)) | st.sampled_from([flat[i].item() for i in range(flat.numel())])
    new = draw(new_from.map(lambda v: _element(v, dtype)).filter(lambda t: not _numerically_same(t.item(), old)))
    b = a.clone()
    b.reshape(-1)[index] = new
    return a, b, index


def _element(value, dtype: torch.dtype) -> torch.Tensor:
    """`value` as a 0-d tensor of `dtype` (uint64 past 2^63 through its int64 bits)."""
    if dtype == torch.uint64 and value >= 2**63:
        return torch.tensor(value - 2**64, dtype=torch.int64).view(torch.uint64)
    return torch.tensor(value, dtype=dtype)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(case=one_element_apart())
def test_property_one_element_apart_differs_and_a_equals_a(case, tmp_path):
    a, b, index = case
    pa, pb = _files(tmp_path, {"x": a}, {"x": b})
    for x, y in ((pa, pb), (pb, pa)):
        report = diff_checkpoints(x, y)
        (t,) = report.tensors
        assert (report.equal, t.mismatched, t.bit_identical) == (False, 1, False), (a, b)
        assert t.worst_index == _unravel(index, a.shape)
    for path in (pa, pb):
        report = diff_checkpoints(path, path)
        assert report.equal and report.tensors[0].bit_identical
    bitwise = diff_checkpoints(pa, pb, bitwise=True)
    assert not bitwise.equal and bitwise.tensors[0].mismatched == 1


def test_slices_of_a_block_find_the_worst_element(tmp_path, monkeypatch):
    """A block is compared a slice at a time: the counts add up and the worst element is the
    largest differing one of every slice, at its index in the tensor."""
    import ckptlib.offline.diff as diff_module

    monkeypatch.setattr(diff_module, "SLICE", 4)
    a = torch.zeros(3, 5)
    b = a.clone()
    b[0, 1], b[2, 3], b[1, 4] = 1.0, 5.0, -2.0
    ab, ba = both_ways(tmp_path, a, b)
    for report, (x, y) in ((ab, (0.0, 5.0)), (ba, (5.0, 0.0))):
        (t,) = report.tensors
        assert (t.mismatched, t.max_abs_diff, t.worst_index, t.worst_a, t.worst_b) == (3, 5.0, [2, 3], x, y)
    assert both_ways(tmp_path, torch.tensor(2.0), torch.tensor(3.0))[0].tensors[0].worst_index == []


def test_numpy_objects_compare_by_dtype_and_value(tmp_path):
    import numpy as np

    a = {"t": torch.ones(1), "arr": np.array([1.0, np.nan]), "ints": np.array([2**53 + 1]), "s": np.array(["x"])}
    b = {"t": torch.ones(1), "arr": np.array([1.0, np.nan]), "ints": np.array([2**53]), "s": np.array(["x"])}
    pa, pb = _files(tmp_path, a, b)
    equal = {o["key"]: o["equal"] for o in diff_checkpoints(pa, pb, trusted=True).objects}
    assert equal == {"arr": True, "ints": False, "s": True}


BELOW = math.nextafter  # the float just below a bound: just outside the tolerance


@pytest.mark.parametrize(
    "atol, rtol, equal",
    [
        (1.0, 0.0, True),
        (BELOW(1.0, 0.0), 0.0, False),
        (0.0, 0.25, True),  # 0.25 * max(|3|, |4|) = 1
        (0.0, BELOW(0.25, 0.0), False),
        (0.5, 0.125, True),  # 0.5 + 0.125 * 4 = 1
        (0.5 - 2**-53, 0.125, False),  # the sum is the float just below 1
    ],
    ids=["atol-at-gap", "atol-just-below", "rtol-at-gap", "rtol-just-below", "both-at-gap", "both-just-below"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_a_gap_just_inside_the_tolerance_is_equal_just_outside_differs(tmp_path, capsys, atol, rtol, equal, dtype):
    """3 against 4 (a gap of 1, exact in every dtype): equal at a tolerance of exactly 1, DIFFERENT
    and reported at the float just below, both ways round, from the command line."""
    pa, pb = _files(tmp_path, {"x": torch.tensor([3, 7], dtype=dtype)}, {"x": torch.tensor([4, 7], dtype=dtype)})
    for x, y, (va, vb) in ((pa, pb, (3, 4)), (pb, pa, (4, 3))):
        rc = cli.main(["diff", x, y, "--atol", repr(atol), "--rtol", repr(rtol), "--no-progress"])
        out = capsys.readouterr().out
        assert (rc, out.splitlines()[-1]) == ((0, "EQUAL") if equal else (1, "DIFFERENT")), out
        shown = (va, vb) if dtype == torch.int32 else (float(va), float(vb))
        where = f"at [0] (A {shown[0]!r}, B {shown[1]!r})"
        line = f"differs: model.x: 1 of 2 elements beyond tolerance; max abs diff 1 {where}"
        assert [ln for ln in out.splitlines() if ln.startswith("differs")] == (
            [] if equal else [line + "; max rel diff 0.25"]
        )
        assert f"1 tensors compared: 0 bit-identical, {int(equal)} equal within" in out


@pytest.mark.parametrize("tolerance", [[], ["--atol", "1e9", "--rtol", "1"]], ids=["exact", "any-tolerance"])
def test_a_dtype_difference_is_reported_whatever_the_tolerance(tmp_path, capsys, tolerance):
    pa, pb = _files(tmp_path, {"x": torch.tensor([3.0, 7.0])}, {"x": torch.tensor([3.0, 7.0], dtype=torch.float64)})
    assert cli.main(["diff", pa, pb, "--no-progress", *tolerance]) == 1
    out = capsys.readouterr().out
    assert "differs: model.x: dtype torch.float32 vs torch.float64; 0 of 2 elements beyond tolerance" in out
    assert out.splitlines()[-1] == "DIFFERENT"
