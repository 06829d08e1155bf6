"""`ckpt diff`'s tolerances at their bounds (`ckptlib.offline.diff_values.compare_values`),
both ways round: |a - b| <= atol + rtol * max(|a|, |b|) with the relative part scaled by the
larger magnitude (integers and complex numbers too), a fractional tolerance on integers exact
(a gap of 3 passes 3.0, not 2.999), a tolerance of 2^64 covering every uint64 gap, int64
against uint64, the complex gap the modulus, the largest relative difference over every
element, and atol/rtol reaching the comparison as given."""

from __future__ import annotations

import pytest
import torch

from ckptlib.offline.diff import diff_checkpoints
from ckptlib.offline.diff_values import Rule, compare_values


def _both(a: torch.Tensor, b: torch.Tensor, **rule) -> tuple[bool, bool]:
    r = Rule(**rule)
    return compare_values(a, b, r).mismatched == 0, compare_values(b, a, r).mismatched == 0


@pytest.mark.parametrize(
    ("atol", "equal"), [(2.0, False), (2.5, False), (2.999, False), (3.0, True), (3.5, True)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32], ids=str)
def test_an_integer_gap_against_a_fractional_tolerance(dtype, atol, equal):
    a, b = torch.tensor([7, 10], dtype=dtype), torch.tensor([7, 13], dtype=dtype)
    assert _both(a, b, atol=atol) == (equal, equal)


@pytest.mark.parametrize(("rtol", "equal"), [(0.33, False), (1 / 3, True), (0.34, True)], ids=["0.33", "third", "0.34"])
def test_an_integer_relative_tolerance_scales_by_the_larger_magnitude(rtol, equal):
    a, b = torch.tensor([100, -150], dtype=torch.int64), torch.tensor([150, -100], dtype=torch.int64)
    assert _both(a, b, rtol=rtol) == (equal, equal)  # a gap of 50 at max(|a|, |b|) = 150


def test_a_float_relative_tolerance_scales_by_the_larger_magnitude():
    a, b = torch.tensor([100.0, -150.0], dtype=torch.float64), torch.tensor([150.0, -100.0], dtype=torch.float64)
    assert _both(a, b, rtol=0.34) == (True, True)
    assert _both(a, b, rtol=0.33) == (False, False)
    assert _both(a, b, atol=49.0, rtol=0.01) == (True, True)  # 49 + 1.5 covers 50
    assert _both(a, b, atol=48.0, rtol=0.01) == (False, False)


def test_a_complex_gap_is_the_modulus_and_its_tolerance_scales_by_the_modulus():
    zero, z = torch.tensor([0j], dtype=torch.complex128), torch.tensor([3 + 4j], dtype=torch.complex128)
    result = compare_values(zero, z, Rule())
    assert (result.mismatched, result.max_abs_diff, result.max_rel_diff) == (1, 5.0, 1.0)
    assert _both(zero, z, atol=5.0) == (True, True)
    assert _both(zero, z, atol=4.99) == (False, False)
    a, b = torch.tensor([3 + 4j], dtype=torch.complex128), torch.tensor([3 + 4.5j], dtype=torch.complex128)
    assert _both(a, b, rtol=0.1) == (True, True)  # 0.5 <= 0.1 * |3 + 4.5j| (5.41), not 0.1 * 3


def test_a_tolerance_of_2_64_covers_every_uint64_gap():
    top, zero = torch.tensor([2**64 - 1], dtype=torch.uint64), torch.tensor([0], dtype=torch.uint64)
    assert _both(top, zero, atol=2.0**64) == (True, True)
    assert _both(top, zero, atol=2.0**63) == (False, False)


@pytest.mark.parametrize(("atol", "equal"), [(1.9, False), (2.0, True)])
def test_int64_against_uint64_is_exact(atol, equal):
    signed, unsigned = torch.tensor([-1, 5], dtype=torch.int64), torch.tensor([1, 5], dtype=torch.uint64)
    assert _both(signed, unsigned, atol=atol) == (equal, equal)
    result = compare_values(signed, unsigned, Rule())
    assert (result.mismatched, result.max_abs_diff, result.worst) == (1, 2, 0)


def test_the_largest_relative_difference_is_over_every_element():
    a, b = torch.tensor([1.0, 100.0, 7.0]), torch.tensor([2.0, 150.0, 7.0])
    result = compare_values(a, b, Rule())
    assert (result.mismatched, result.max_abs_diff, result.worst, result.max_rel_diff) == (2, 50.0, 1, 0.5)


def test_atol_and_rtol_reach_the_comparison_as_given(tmp_path):
    pa, pb = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    torch.save({"x": torch.tensor([100.0])}, pa)
    torch.save({"x": torch.tensor([110.0])}, pb)
    assert diff_checkpoints(pa, pb, rtol=0.1).equal  # 10 <= 0.1 * 110
    assert not diff_checkpoints(pa, pb, atol=0.1).equal
    assert diff_checkpoints(pa, pb, atol=10.0).equal
    assert not diff_checkpoints(pa, pb, rtol=0.09).equal  # 9.9 < 10
    report = diff_checkpoints(pa, pb, atol=0.5, rtol=0.25)
    assert (report.atol, report.rtol, report.to_json()["atol"], report.to_json()["rtol"]) == (0.5, 0.25, 0.5, 0.25)
