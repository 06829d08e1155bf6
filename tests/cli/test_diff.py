"""`ckpt diff A B`: a single flipped element of a 10^7-element tensor, between checkpoints saved
sharded at 2 and at 3 ranks, is found and reported (key, index, both values); equal checkpoints
of different formats and world sizes are EQUAL; keys, shapes, dtypes, objects and tolerances;
reads stay in blocks; every error exits 2."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptlib
from ckptlib import cli
from ckptlib.offline.diff import DiffError, diff_checkpoints

ROWS, COLS = 2500, 4000  # 10^7 elements
FLIP = (1913, 2321)


def _big() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))


def save_sharded(uri: str, flip: bool) -> None:
    """Rank body: the big tensor as a DTensor sharded by rows (one element flipped if asked)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    big = _big()
    if flip:
        bits = big.view(torch.int32)
        bits[FLIP] ^= 1 << 22  # one mantissa bit of one element
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"model": {"big": distribute_tensor(big, mesh, [Shard(0)]), "bias": torch.arange(7.0)}, "lr": 0.01}
    ckptlib.save(uri, state, step=3)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def pair(tmp_path_factory, dist_run_module):
    root = tmp_path_factory.mktemp("diff")
    a, b = str(root / "a-2ranks"), str(root / "b-3ranks")
    dist_run_module(2, save_sharded, a, False)
    dist_run_module(3, save_sharded, b, True)
    return a, b


@pytest.fixture(scope="module")
def dist_run_module():
    from ckptlib.testing import launch

    return lambda n, fn, *args: launch(n, fn, *args, timeout=240)


def test_finds_one_flipped_element_among_ten_million(pair, capsys):
    a, b = pair
    rc, out, _ = _run(capsys, "diff", a, b, "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["equal"] is False and doc["a"]["world_size"] == 2 and doc["b"]["world_size"] == 3
    (big,) = [t for t in doc["tensors"] if t["key"] == "model.big"]
    expected_a = _big()[FLIP].item()
    flipped = _big()
    flipped.view(torch.int32)[FLIP] ^= 1 << 22
    assert big["numel"] == 10**7 and big["mismatched"] == 1 and big["bit_identical"] is False
    assert big["worst_index"] == list(FLIP) and big["worst_a"] == expected_a and big["worst_b"] == flipped[FLIP].item()
    assert big["max_abs_diff"] == abs(expected_a - flipped[FLIP].item())
    assert doc["summary"] == {
        "tensors": 2,
        "bit_identical": 1,
        "within_tolerance": 0,
        "different": 1,
        "shape_or_dtype_mismatch": 0,
        "only_in_a": 0,
        "only_in_b": 0,
        "objects": 1,
        "objects_different": 0,
    }
    rc, out, _ = _run(capsys, "diff", a, b)
    assert rc == 1
    assert "differs: model.big: 1 of 10000000 elements beyond tolerance; max abs diff" in out
    assert f"at {list(FLIP)} (A {expected_a!r}, B {flipped[FLIP].item()!r})" in out
    assert out.splitlines()[-1] == "DIFFERENT"


def test_a_tolerance_that_covers_the_flip_makes_them_equal(pair, capsys):
    a, b = pair
    rc, out, _ = _run(capsys, "diff", a, b, "--rtol", "1")
    assert rc == 0 and out.splitlines()[-1] == "EQUAL"
    assert "1 bit-identical, 1 equal within atol=0 rtol=1, 0 different" in out


def test_reads_stay_in_blocks(pair, monkeypatch):
    """Bounded memory: no read larger than a block, however large the tensor."""
    import ckptlib.offline.diff as diff_module

    sizes = []
    original = diff_module.read_block

    def recording(side, key, start, rows):
        block = original(side, key, start, rows)
        sizes.append(block.numel() * block.element_size())
        return block

    monkeypatch.setattr(diff_module, "read_block", recording)
    report = diff_checkpoints(*pair, block_bytes=1 << 20, only="model")
    assert not report.equal and max(sizes) <= 1 << 20
    assert sum(sizes) == 2 * (ROWS * COLS * 4 + 7 * 4)  # every byte of both sides, once


def test_equal_across_formats_and_world_sizes(pair, tmp_path, capsys):
    """The 2-rank checkpoint against its own torch.save conversion (one file, no ranks)."""
    a, _ = pair
    converted = tmp_path / "a.pt"
    ckptlib.convert(a, str(converted), to="torch")
    rc, out, _ = _run(capsys, "diff", a, converted)
    assert rc == 0, out
    assert "2 tensors compared: 2 bit-identical" in out and out.splitlines()[-1] == "EQUAL"
    assert "(torch_save)" in out.splitlines()[1]


def test_keys_shapes_dtypes_objects_and_nan(tmp_path, capsys):
    nan = torch.tensor([1.0, float("nan"), 3.0])
    left = {
        "model": {"w": torch.ones(3, 2), "v": torch.zeros(4), "n": nan.clone(), "gone": torch.ones(1)},
        "opt": {"lr": 0.1},
    }
    right = {
        "model": {
            "w": torch.ones(2, 3),
            "v": torch.zeros(4, dtype=torch.float64),
            "n": nan.clone(),
            "new": torch.ones(1),
        },
        "opt": {"lr": 0.1},
    }
    ckptlib.save(str(tmp_path / "l"), left)
    ckptlib.save(str(tmp_path / "r"), right)
    report = diff_checkpoints(str(tmp_path / "l"), str(tmp_path / "r"))
    assert report.only_in_a == ["model.gone"] and report.only_in_b == ["model.new"]
    assert report.mismatched == [
        {
            "key": "model.w",
            "a": {"shape": [3, 2], "dtype": "torch.float32"},
            "b": {"shape": [2, 3], "dtype": "torch.float32"},
        }
    ]
    by_key = {t.key: t for t in report.tensors}
    assert by_key["model.n"].bit_identical and by_key["model.n"].within_tolerance  # NaN where NaN is
    v = by_key["model.v"]
    assert (v.dtype_a, v.dtype_b, v.mismatched, v.max_abs_diff, v.within_tolerance) == (
        "torch.float32",
        "torch.float64",
        0,
        0.0,
        False,
    )
    assert report.objects == [{"key": "opt.lr", "equal": True, "a": "0.1", "b": "0.1"}]
    rc, out, _ = _run(capsys, "diff", tmp_path / "l", tmp_path / "r")
    assert rc == 1
    assert "only in A (1): model.gone" in out and "only in B (1): model.new" in out
    assert "differs in shape or kind: model.w: torch.float32(3, 2) vs torch.float32(2, 3)" in out
    assert "differs: model.v: dtype torch.float32 vs torch.float64; 0 of 4 elements" in out


@pytest.mark.parametrize(
    "case",
    ["missing", "corrupt", "only-nothing", "bad-tolerance"],
)
def test_errors_exit_2(case, pair, tmp_path, capsys):
    a, _ = pair
    other = a
    extra: list[str] = []
    if case == "missing":
        other = str(tmp_path / "nothing-here")
    elif case == "corrupt":
        a, other = str(tmp_path / "intact"), str(tmp_path / "corrupt")
        for uri in (a, other):
            ckptlib.save(uri, {"model": {"x": torch.arange(100000.0)}})
        shard = next(n for n in os.listdir(other) if n.endswith(".distcp"))
        with open(os.path.join(other, shard), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(other, shard)) // 2)
            f.write(b"\xff" * 8)
    elif case == "only-nothing":
        extra = ["--only", "no_such_entry"]
    if case == "bad-tolerance":
        with pytest.raises(SystemExit) as info:
            cli.main(["diff", a, a, "--atol", "-1"])
        assert info.value.code == 2
        return
    rc, out, err = _run(capsys, "diff", a, other, *extra)
    assert rc == 2 and out == "" and err.startswith("ckpt diff: error: ")
    if case == "only-nothing":
        assert "--only no_such_entry: neither" in err
        with pytest.raises(DiffError):
            diff_checkpoints(a, a, only="no_such_entry")
    if case == "corrupt":
        assert "checksum mismatch" in err
