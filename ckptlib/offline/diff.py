"""`diff_checkpoints`: compare two checkpoints of any formats ckptlib reads, saved at any world
sizes, tensor by tensor (`ckpt diff`).

Keys are the flat DCP keys of this torch's flattening rules (`model.layers.0.weight`,
`optim.state.layers.0.weight.exp_avg`, `optim.param_groups.0.lr`; torch.save and safetensors
model files under `model.`), whichever rules each side was saved with: torch 1.13's flat
dotted keys and whole-pickled values and torch 2.0-2.3's whole-pickled nested values are
re-keyed as `ckpt convert` re-keys them (`SourceValues.current_keys`), so a checkpoint compares
equal with its conversion, and one saved by 8 ranks with one saved by 3, or with its own
safetensors export. (Where two stored entries would share a key today, the keys are compared
as stored.) Each tensor is read in blocks of whole rows (`block_bytes`, default 16 MiB,
one row at least) straight from each side's reader, assembled from however many chunks each
side stored it in, so memory stays a few blocks whatever the tensor or checkpoint size.

Per tensor: bit-identical or not (its bytes), the elements that differ by the rules of
`diff_values` (integers as integers; NaN equal to NaN unless `equal_nan=False`; a finite value
against a non-finite one always different; -0.0 equal to 0.0 unless `bitwise=True`; beyond
``atol + rtol * max(|a|, |b|)``), the maximum absolute and relative difference and where the
largest one is (its index and both values). Non-tensor entries (hyperparameters, counters) are
equal when of the same type and value. Equal: the same keys, shapes and dtypes, every tensor
within the tolerance and every other entry equal; diff(A, B) and diff(B, A) agree.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlib.errors import CheckpointError, StateError
from ckptlib.format.source import inspect_checkpoint, open_reader
from ckptlib.format.streaming import CurrentKeys, SourceValues
from ckptlib.offline.diff_values import Rule, compare_values, same_object
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage

BLOCK_BYTES = 16 << 20
EXACT = Rule()  # atol=rtol=0, NaN equal to NaN, -0.0 equal to 0.0
SLICE = 1 << 20  # elements compared at once


class DiffError(CheckpointError):
    """Two checkpoints cannot be compared as asked (e.g. `only` names no entry of either)."""


@dataclasses.dataclass
class Side:
    """One checkpoint of the comparison, keyed by this torch's flattening rules whichever torch
    wrote it (`SourceValues.current_keys`): `stored` key -> the tensor's own stored key,
    `inline` key -> a tensor torch 1.13 pickled inside a whole object (in memory), `objects`
    key -> every other value."""

    uri: str
    format: str
    step: int | None
    world_size: int | None
    values: SourceValues
    stored: dict[str, str] = dataclasses.field(default_factory=dict)
    inline: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    objects: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"uri": self.uri, "format": self.format, "step": self.step, "world_size": self.world_size}

    @property
    def keys(self) -> list[str]:
        return list(self.stored) + list(self.inline) + list(self.objects)

    def is_tensor(self, key: str) -> bool:
        return key in self.stored or key in self.inline

    def shape(self, key: str) -> list[int]:
        if key in self.inline:
            return list(self.inline[key].shape)
        return list(self.values.tensor_meta(self.stored[key]).size)

    def dtype(self, key: str) -> torch.dtype:
        if key in self.inline:
            return self.inline[key].dtype
        return self.values.tensor_meta(self.stored[key]).properties.dtype

    def nbytes(self, key: str) -> int:
        if key in self.inline:
            return self.inline[key].numel() * self.inline[key].element_size()
        return self.values.nbytes(self.stored[key])


@dataclasses.dataclass
class TensorDiff:
    """How one tensor differs (`worst_*`: where the largest absolute difference of a differing
    element is, or of any element when none differs; `max_abs_diff` is that difference)."""

    key: str
    shape: list[int]
    dtype_a: str
    dtype_b: str
    numel: int
    bit_identical: bool = True
    mismatched: int = 0  # elements beyond the tolerance
    max_abs_diff: float | int = 0.0  # an int (exact) for integer tensors
    max_rel_diff: float = 0.0
    worst_index: list[int] | None = None
    worst_a: Any = None
    worst_b: Any = None

    @property
    def within_tolerance(self) -> bool:
        return self.mismatched == 0 and self.dtype_a == self.dtype_b


@dataclasses.dataclass
class DiffReport:
    a: dict[str, Any]
    b: dict[str, Any]
    atol: float
    rtol: float
    equal_nan: bool
    bitwise: bool
    only_in_a: list[str]
    only_in_b: list[str]
    mismatched: list[dict[str, Any]]  # {"key", "a": {"shape", "dtype"}, "b": {...}}: not compared
    tensors: list[TensorDiff]
    objects: list[dict[str, Any]]  # {"key", "equal", "a", "b"}

    @property
    def equal(self) -> bool:
        return (
            not self.only_in_a
            and not self.only_in_b
            and not self.mismatched
            and all(t.within_tolerance for t in self.tensors)
            and all(o["equal"] for o in self.objects)
        )

    def summary(self) -> dict[str, int]:
        return {
            "tensors": len(self.tensors),
            "bit_identical": sum(t.bit_identical and t.within_tolerance for t in self.tensors),
            "within_tolerance": sum(t.within_tolerance and not t.bit_identical for t in self.tensors),
            "different": sum(not t.within_tolerance for t in self.tensors),
            "shape_or_dtype_mismatch": len(self.mismatched),
            "only_in_a": len(self.only_in_a),
            "only_in_b": len(self.only_in_b),
            "objects": len(self.objects),
            "objects_different": sum(not o["equal"] for o in self.objects),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "a": self.a,
            "b": self.b,
            "atol": self.atol,
            "rtol": self.rtol,
            "equal_nan": self.equal_nan,
            "bitwise": self.bitwise,
            "summary": self.summary(),
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
            "mismatched": self.mismatched,
            "tensors": [_tensor_json(t) for t in self.tensors],
            "objects": self.objects,
        }


def _tensor_json(t: TensorDiff) -> dict[str, Any]:
    doc = dict(dataclasses.asdict(t), within_tolerance=t.within_tolerance)
    for name in ("max_abs_diff", "max_rel_diff"):
        if isinstance(doc[name], float) and not math.isfinite(doc[name]):
            doc[name] = str(doc[name])  # JSON has no NaN or infinity
    return doc


def _open(uri: str | os.PathLike | Storage, trusted: bool, only: str | None = None) -> Side:
    storage = as_storage(uri)
    info = inspect_checkpoint(storage, verify=True, trusted=trusted)
    reader, info = open_reader(storage, info=info, verify=True, trusted=trusted)
    values = SourceValues(reader, info.metadata, trusted=trusted, uri=storage.uri)
    side = Side(storage.uri, info.kind, info.step, info.world_size, values)

    def wanted(key: str) -> bool:  # the objects `only` may need (one stored whole may hold it)
        return only is None or key == only or key.startswith(only + ".") or only.startswith(key + ".")

    try:
        current = values.current_keys(wanted)
    except StateError:  # two entries share a key under today's rules: compare the keys as stored
        chosen = [k for k in values.object_keys if wanted(k)]
        current = CurrentKeys({}, {k: k for k in values.tensor_keys}, values.objects(chosen))
    side.stored = current.stored
    for key, value in current.values.items():
        (side.inline if isinstance(value, torch.Tensor) else side.objects)[key] = value
    return side


class _BlockPlanner(LoadPlanner):
    """Hands a reader's tensor reads views of one block of a tensor (rows [start, start + n))."""

    def __init__(self, block: torch.Tensor):
        self.block = block

    def resolve_tensor(self, read_item) -> torch.Tensor:
        view = self.block
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # the reader copied into the view resolve_tensor gave it

    def load_bytes(self, read_item, value) -> None:
        raise DiffError(f"{read_item.dest_index.fqn}: a tensor read was answered with bytes")


def read_block(side: Side, key: str, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) (along dim 0; elements of a 1-D tensor) of tensor `key`."""
    if key in side.inline:
        whole = side.inline[key]
        return whole.narrow(0, start, rows) if whole.dim() else whole
    fqn = side.stored[key]
    md: TensorStorageMetadata = side.values.tensor_meta(fqn)
    size = list(md.size)
    if not size:  # a 0-d tensor
        return side.values.tensor(fqn)
    offsets = [start] + [0] * (len(size) - 1)
    sizes = [rows] + size[1:]
    block = torch.empty(sizes, dtype=md.properties.dtype)
    if block.numel():
        items = create_read_items_for_chunk_list(
            fqn, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
        )
        side.values.reader.read_data(LoadPlan(items), _BlockPlanner(block)).wait()
    return block


def _fold(diff: TensorDiff, a: torch.Tensor, b: torch.Tensor, base: int, rule: Rule, best: list) -> None:
    """Fold one block (its first element is element `base` of the flat tensor) into `diff`,
    `SLICE` elements at a time (the comparison's float64 temporaries stay small); `best` holds
    the (differs, gap) of the worst element so far."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    for start in range(0, max(flat_a.numel(), 1), SLICE):
        part_a, part_b = (flat_a[start : start + SLICE], flat_b[start : start + SLICE]) if a.dim() else (a, b)
        found = compare_values(part_a, part_b, rule)
        diff.bit_identical &= found.bit_identical
        diff.mismatched += found.mismatched
        diff.max_rel_diff = max(diff.max_rel_diff, found.max_rel_diff)
        key = (found.worst_differs, found.max_abs_diff)
        if (found.bit_identical and not found.mismatched) or (best and key <= best[0]):
            continue
        best[:] = [key]
        diff.max_abs_diff = found.max_abs_diff
        diff.worst_index = [int(i) for i in _unravel(base + start + found.worst, diff.shape)]
        diff.worst_a, diff.worst_b = _scalar(part_a.reshape(-1)[found.worst]), _scalar(part_b.reshape(-1)[found.worst])


def _unravel(flat: int, shape: list[int]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return list(reversed(out))


def _scalar(t: torch.Tensor) -> Any:
    value = t.item()
    if isinstance(value, complex):
        return [value.real, value.imag]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or infinity
    return value


def compare_tensor(
    a: Side, b: Side, key: str, *, rule: Rule = EXACT, block_bytes: int = BLOCK_BYTES, on_bytes=None
) -> TensorDiff:
    """`key` of `a` against `key` of `b` (the same shape), block by block, by `rule`."""
    shape = a.shape(key)
    diff = TensorDiff(key, shape, str(a.dtype(key)), str(b.dtype(key)), math.prod(shape))
    rows_total = shape[0] if shape else 1
    row_elems = math.prod(shape[1:]) if shape else 1
    item = max(a.nbytes(key), b.nbytes(key)) // max(diff.numel, 1) or 1
    rows = max(1, block_bytes // max(1, row_elems * item))
    best: list = []
    for start in range(0, rows_total, rows):
        n = min(rows, rows_total - start)
        block_a, block_b = read_block(a, key, start, n), read_block(b, key, start, n)
        _fold(diff, block_a, block_b, start * row_elems, rule, best)
        if on_bytes is not None:
            on_bytes(block_a.numel() * block_a.element_size() + block_b.numel() * block_b.element_size())
    return diff


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def diff_checkpoints(
    a: str | os.PathLike | Storage,
    b: str | os.PathLike | Storage,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    equal_nan: bool = True,
    bitwise: bool = False,
    only: str | None = None,
    trusted: bool = False,
    block_bytes: int = BLOCK_BYTES,
    on_start: Callable[[int], None] | None = None,
    on_tensor: Callable[[str, int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> DiffReport:
    """Compare checkpoint `a` with checkpoint `b` (any formats, any saved world sizes) in one
    process, by the rules of `diff_values` (`equal_nan`: NaN equals NaN; `bitwise`: elements
    equal only when their bits are, atol and rtol 0). `only`: compare just the keys under this
    top-level entry (e.g. "model").
    Progress: `on_start(total bytes to read)`, `on_tensor(key, nbytes)` before each tensor,
    `on_bytes(n)` after each block."""
    if atol < 0 or rtol < 0 or not math.isfinite(atol) or not math.isfinite(rtol):
        raise DiffError(f"atol and rtol must be finite and not negative, got atol={atol} rtol={rtol}")
    if bitwise and (atol or rtol or not equal_nan):
        raise DiffError(
            f"bitwise compares bits: atol and rtol must be 0 and NaN is equal only to the same bits, got "
            f"atol={atol} rtol={rtol} equal_nan={equal_nan}"
        )
    rule = Rule(atol, rtol, equal_nan, bitwise)
    side_a, side_b = _open(a, trusted, only), _open(b, trusted, only)

    def keys(side: Side) -> list[str]:
        return [k for k in side.keys if only is None or k == only or k.startswith(only + ".")]

    keys_a, keys_b = keys(side_a), keys(side_b)
    if only is not None and not keys_a and not keys_b:
        raise DiffError(f"--only {only}: neither {side_a.uri} nor {side_b.uri} has an entry {only!r}")
    in_b = set(keys_b)
    common = [k for k in keys_a if k in in_b]
    report = DiffReport(
        a=side_a.describe(),
        b=side_b.describe(),
        atol=atol,
        rtol=rtol,
        equal_nan=equal_nan,
        bitwise=bitwise,
        only_in_a=sorted(set(keys_a) - in_b),
        only_in_b=sorted(in_b - set(keys_a)),
        mismatched=[],
        tensors=[],
        objects=[],
    )
    if on_start is not None:
        both = [k for k in common if side_a.is_tensor(k) and side_b.is_tensor(k)]
        on_start(sum(side_a.nbytes(k) + side_b.nbytes(k) for k in both))
    for key in common:
        if side_a.is_tensor(key) and side_b.is_tensor(key):
            shape_a, shape_b = side_a.shape(key), side_b.shape(key)
            if shape_a != shape_b:
                report.mismatched.append(
                    {
                        "key": key,
                        "a": {"shape": shape_a, "dtype": str(side_a.dtype(key))},
                        "b": {"shape": shape_b, "dtype": str(side_b.dtype(key))},
                    }
                )
                continue
            if on_tensor is not None:
                on_tensor(key, side_a.nbytes(key) + side_b.nbytes(key))
            report.tensors.append(
                compare_tensor(side_a, side_b, key, rule=rule, block_bytes=block_bytes, on_bytes=on_bytes)
            )
        elif side_a.is_tensor(key) or side_b.is_tensor(key):
            kinds = ["a tensor" if side.is_tensor(key) else "not a tensor" for side in (side_a, side_b)]
            report.mismatched.append({"key": key, "a": {"kind": kinds[0]}, "b": {"kind": kinds[1]}})
        else:
            x, y = side_a.objects[key], side_b.objects[key]
            equal = same_object(x, y, rule)
            report.objects.append({"key": key, "equal": equal, "a": _shown(x), "b": _shown(y)})
    return report


__all__ = [
    "BLOCK_BYTES",
    "EXACT",
    "DiffError",
    "DiffReport",
    "TensorDiff",
    "compare_tensor",
    "diff_checkpoints",
    "read_block",
]
