"""`compare_values`: which elements of two equal-shaped tensors differ, by exact rules (`ckpt diff`).

Integers are compared as integers (their gap exact, never through float64); floats and complex
numbers in float64, which holds every narrower float exactly. The same infinity equals itself,
NaN equals NaN when `equal_nan`, a finite value against a non-finite one (or inf against
-inf, or NaN against anything else) differs whatever the tolerance. -0.0 equals 0.0 unless
`bitwise`, which compares the stored bits. The tolerance is symmetric in A and B:
``|a - b| <= atol + rtol * max(|a|, |b|)``, and at atol=rtol=0 only equal values pass.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np
import torch

_U64_SPAN = 2.0**64
_SIGN = np.uint64(1 << 63)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How elements are compared (see the module)."""

    atol: float = 0.0
    rtol: float = 0.0
    equal_nan: bool = True
    bitwise: bool = False


@dataclasses.dataclass
class BlockResult:
    """What one comparison found: the differing elements and the largest differences, and where
    the largest is (a differing element first; `worst`: its flat index in the block)."""

    mismatched: int
    bit_identical: bool
    max_abs_diff: float | int
    max_rel_diff: float
    worst: int
    worst_differs: bool


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes of each element: one row per element."""
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def bit_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _is_int(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def _ints(t: torch.Tensor) -> np.ndarray:
    flat = t.reshape(-1)
    return flat.to(torch.uint8).numpy() if t.dtype == torch.bool else flat.numpy()


def _int_gap(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """|x - y| exactly: uint64, or Python ints where it may not fit (int64 against uint64)."""
    unsigned = {x.dtype == np.uint64, y.dtype == np.uint64}
    if unsigned == {True, False} and (x.dtype.kind == "i" or y.dtype.kind == "i"):
        return np.abs(x.astype(object) - y.astype(object))
    if True in unsigned:
        ux, uy = x.astype(np.uint64), y.astype(np.uint64)
    else:  # order-preserving: the sign bit flipped maps int64 onto uint64
        ux, uy = x.astype(np.int64).view(np.uint64) ^ _SIGN, y.astype(np.int64).view(np.uint64) ^ _SIGN
    return np.where(ux >= uy, ux - uy, uy - ux)


def _beyond(gap: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """gap > tol exactly, for integer gaps (uint64 or Python ints) and float64 tolerances."""
    if gap.dtype == object:
        return np.array([g > t for g, t in zip(gap.tolist(), tol.tolist())], dtype=bool)
    floor = np.floor(tol)
    huge = floor >= _U64_SPAN  # no uint64 gap exceeds it
    return (gap > np.where(huge, 0.0, floor).astype(np.uint64)) & ~huge


def _result(mism: np.ndarray, gap: np.ndarray, rel: np.ndarray, integral: bool, bits_same: bool) -> BlockResult:
    """The counts and the worst element: the largest gap of a differing element (of any
    element when none differs)."""
    n = int(mism.sum())
    order = np.flatnonzero(mism) if n else np.arange(len(gap))
    worst = int(order[int(np.argmax(gap[order]))]) if len(order) else 0
    top = gap[worst] if len(gap) else 0
    return BlockResult(
        n,
        bits_same,
        int(top) if integral else float(top),
        float(rel.max()) if len(rel) else 0.0,
        worst,
        bool(n),
    )


def _rel(gap: np.ndarray, scale: np.ndarray) -> np.ndarray:
    gap = gap.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, gap / np.where(scale > 0, scale, 1.0), np.where(gap > 0, math.inf, 0.0))


def _compare_ints(a: torch.Tensor, b: torch.Tensor, rule: Rule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(differs, exact gap, relative gap) of each element of two integer tensors."""
    x, y = _ints(a), _ints(b)
    gap = _int_gap(x, y)
    scale = np.maximum(np.abs(x.astype(np.float64)), np.abs(y.astype(np.float64)))
    return _beyond(gap, rule.atol + rule.rtol * scale), gap, _rel(gap, scale)


def _int_equals_float(x: np.ndarray, f: np.ndarray) -> np.ndarray:
    """Which integers x equal the float64 values f exactly (no rounding of x)."""
    lo, hi = (0.0, _U64_SPAN) if x.dtype == np.uint64 else (-(2.0**63), 2.0**63)
    wide = x if x.dtype == np.uint64 else x.astype(np.int64)
    with np.errstate(invalid="ignore"):
        ok = (f == wide.astype(np.float64)) & (f >= lo) & (f < hi)
        back = np.where(ok, f, 0.0).astype(wide.dtype)
    return ok & (back == wide)


def _parts(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    flat = t.reshape(-1)
    if t.is_complex():
        wide = flat.to(torch.complex128)
        return wide.real.numpy(), wide.imag.numpy()
    return flat.to(torch.float64).numpy(), None


def _compare_floats(a: torch.Tensor, b: torch.Tensor, rule: Rule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(differs, gap, relative gap) of each element, in float64 (see the module)."""
    (ar, ai), (br, bi) = _parts(a), _parts(b)
    int_vs_real = _is_int(a) != _is_int(b) and ai is None and bi is None
    if (ai is None) != (bi is None):  # a real tensor against a complex one: a zero imaginary part
        ai, bi = (np.zeros_like(ar) if ai is None else ai), (np.zeros_like(br) if bi is None else bi)
    same = np.ones(len(ar), dtype=bool)
    forced = np.zeros(len(ar), dtype=bool)
    diffs, mags_a, mags_b = [], [], []
    for x, y in ((ar, br), (ai, bi)):
        if x is None:
            continue
        nonfinite = ~(np.isfinite(x) & np.isfinite(y))
        equal = x == y
        if rule.equal_nan:
            equal |= np.isnan(x) & np.isnan(y)
        same &= equal
        forced |= nonfinite & ~equal
        with np.errstate(over="ignore", invalid="ignore"):
            diffs.append(np.where(nonfinite, 0.0, x - y))
        mags_a.append(np.where(np.isfinite(x), x, 0.0))
        mags_b.append(np.where(np.isfinite(y), y, 0.0))
    if int_vs_real:  # an integer against a float: equal only if exactly equal
        ints, floats = (a, br) if _is_int(a) else (b, ar)
        same = _int_equals_float(_ints(ints), floats)
    with np.errstate(over="ignore", invalid="ignore"):
        gap = np.hypot(*diffs) if len(diffs) == 2 else np.abs(diffs[0])
        scale = np.maximum(np.hypot(*mags_a), np.hypot(*mags_b)) if len(diffs) == 2 else None
        if scale is None:
            scale = np.maximum(np.abs(mags_a[0]), np.abs(mags_b[0]))
        tol = rule.atol + rule.rtol * scale
    mism = ~same & (forced | (gap > tol) | (tol == 0))
    gap = np.where(forced, math.inf, np.where(same, 0.0, gap))
    return mism, gap, _rel(gap, scale)


def compare_values(a: torch.Tensor, b: torch.Tensor, rule: Rule) -> BlockResult:
    """Element by element, `a` against `b` (the same number of elements, any dtypes); with
    `rule.bitwise` an element differs when its bits do (the gaps are still the numeric ones)."""
    bits_same = bit_identical(a, b)
    integral = _is_int(a) and _is_int(b)
    exact = rule.equal_nan or not (a.is_floating_point() or a.is_complex())
    if a.numel() == 0 or (bits_same and (exact or not _has_nan(a))):
        return BlockResult(0, bits_same, 0 if integral else 0.0, 0.0, 0, False)
    mism, gap, rel = (_compare_ints if integral else _compare_floats)(a, b, rule)
    if rule.bitwise and a.dtype == b.dtype:
        mism = (_bytes(a) != _bytes(b)).any(dim=1).numpy()
    return _result(mism, gap, rel, integral, bits_same)


def _has_nan(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t.reshape(-1).to(torch.complex128 if t.is_complex() else torch.float64)).any())


def _same_float(x: float, y: float, rule: Rule) -> bool:
    if rule.bitwise:
        return struct.pack("<d", x) == struct.pack("<d", y)
    if math.isnan(x) or math.isnan(y):
        return rule.equal_nan and math.isnan(x) and math.isnan(y)
    return x == y


def same_object(x: Any, y: Any, rule: Rule) -> bool:
    """Whether two non-tensor entries are equal: the same type and value (floats by the rule
    above; containers element by element; tensors of the same dtype and shape, exactly)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, float):
        return _same_float(x, y, rule)
    if isinstance(x, complex):
        return _same_float(x.real, y.real, rule) and _same_float(x.imag, y.imag, rule)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(same_object(p, q, rule) for p, q in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same_object(x[k], y[k], rule) for k in x)
    if isinstance(x, np.ndarray) and x.dtype.kind in "biufc":
        x, y = torch.from_numpy(x), torch.from_numpy(y)
    if isinstance(x, torch.Tensor):
        exact = Rule(equal_nan=rule.equal_nan, bitwise=rule.bitwise)
        return x.dtype == y.dtype and x.shape == y.shape and compare_values(x, y, exact).mismatched == 0
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and bool(np.array_equal(x, y))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - values that cannot be compared are different
        return False


__all__ = ["BlockResult", "Rule", "bit_identical", "compare_values", "same_object"]
