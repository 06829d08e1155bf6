"""Every dtype a checkpoint can hold exports (torch and safetensors) bit-exactly, `--dtype
float8_*` included, or is refused with a named error naming the key before any file is
written; the streamed torch archive stays byte-identical to torch.save's for the dtypes torch
pickles over untyped storages (float8, uint16/32/64).

Before: `ckpt export --format torch` (and `--dtype float8_*`) died with a KeyError traceback
("dtype torch.float8_e4m3fn is not recognized") on float8 and uint16/32/64 tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptlib
from ckptlib.cli import main as cli_main
from ckptlib.format.foreign.torch_archive import TorchArchiveWriter, streaming_torch_save_reason
from ckptlib.offline.export import EXPORT_RECORD

st = pytest.importorskip("safetensors.torch")

UNTYPED = [
    name
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64")
    if isinstance(getattr(torch, name, None), torch.dtype)
]
SAFETENSORS_CAN = {"float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"}


def _values(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-3, 9, dtype=torch.float32).reshape(3, 4).abs().to(dtype)


def _read(out: str, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "torch":
        return torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    return st.load_file(os.path.join(out, "model.safetensors"))


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("name", UNTYPED)
def test_each_dtype_exports_bit_exactly_or_is_refused_by_name(tmp_path, name, fmt):
    dtype = getattr(torch, name)
    src, out = str(tmp_path / "c"), str(tmp_path / "hf")
    state = {"model": {"w": _values(dtype), "b": torch.ones(2)}}
    ckptlib.save(src, state)
    if fmt == "safetensors" and name not in SAFETENSORS_CAN:
        with pytest.raises(ckptlib.UnsupportedError, match=f"w: dtype torch.{name} has no safetensors encoding"):
            ckptlib.export(src, out, format=fmt, model_only=True)
        assert not os.path.exists(out)  # nothing written, not even the directory
        return
    result = ckptlib.export(src, out, format=fmt, model_only=True)
    assert sorted(os.listdir(out)) == sorted([*result.files, EXPORT_RECORD])
    got = _read(out, fmt)
    assert got["w"].dtype == dtype and _bits(got["w"]) == _bits(state["model"]["w"])
    assert torch.equal(got["b"], torch.ones(2))


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("cast", ["float8_e4m3fn", "float8_e5m2"])
def test_export_cast_to_float8_with_the_cli(tmp_path, capsys, fmt, cast):
    src, out = str(tmp_path / "c"), str(tmp_path / "hf")
    w = torch.linspace(-2, 2, 24).reshape(4, 6)
    ckptlib.save(src, {"model": {"w": w, "steps": torch.tensor([3, 4])}})
    rc = cli_main(["export", src, out, "--format", fmt, "--dtype", cast, "--model-only", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    got = _read(out, fmt)
    assert _bits(got["w"]) == _bits(w.to(getattr(torch, cast))) and got["steps"].dtype == torch.int64


def test_the_streamed_archive_is_torch_saves_bytes_for_untyped_storages(tmp_path):
    assert streaming_torch_save_reason() is None
    values = {name: _values(getattr(torch, name)) for name in UNTYPED}
    mine, theirs = str(tmp_path / "mine.bin"), str(tmp_path / "ref" / "mine.bin")
    os.makedirs(os.path.dirname(theirs))
    writer = TorchArchiveWriter(mine, [(k, v.dtype, tuple(v.shape)) for k, v in values.items()])
    for value in values.values():
        writer.add(value)
    writer.close()
    torch.save(values, theirs)
    with open(mine, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
