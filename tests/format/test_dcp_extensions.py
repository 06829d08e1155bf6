"""DCP's stream extensions (zstd compression, custom StreamTransformExtensions), written by
`ckptlib.dcp.writer(extensions=...)` and read by every ckptlib load: a plain DCP checkpoint
written with zstd loads bit-exactly through `ckptlib.load` and verifies; one written with an
extension ckptlib does not know is UnsupportedError (never CheckpointCorruptError) with the
state untouched, and a note from `ckpt verify`; a reader given a registry that knows it reads
it. Checksums cover the stored (compressed) bytes; decoding is bounded by the declared size."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.api import CheckpointException

import ckptlib
import ckptlib.dcp
from ckptlib import cli
from ckptlib.format import verify

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class SwapCase(StreamTransformExtension):
    """A custom extension (as PyTorch's tests' Rot13Example): swaps the case of ASCII letters."""

    @staticmethod
    def registry_name() -> str:
        return "stream.swapcase"

    @staticmethod
    def from_descriptor(version: str) -> "SwapCase":
        return SwapCase()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                return output.write(bytes(b).swapcase())

        return Writer()

    def transform_from(self, input):
        return io.BytesIO(input.read().swapcase())


def _registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(SwapCase)
    return registry


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(700, 600, generator=gen), "b": torch.randn(5, generator=gen), "obj": {"tag": f"s{seed}"}}


def _empty() -> dict:
    return {"w": torch.zeros(700, 600), "b": torch.zeros(5), "obj": {"tag": ""}}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["obj"] == b["obj"]


def _plain_save(uri: str, extensions) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(0), storage_writer=dcp.FileSystemWriter(uri, _extensions=extensions))


def _verify_cli(uri: str, capsys) -> tuple[int, str]:
    code = cli.main(["verify", uri])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_plain_dcp_zstd_checkpoint_loads_and_verifies(tmp_path, capsys):
    uri = str(tmp_path / "zstd")
    _plain_save(uri, [ZStandard()])
    state = _empty()
    assert ckptlib.load(uri, state).format == "dcp"
    assert _same(state, _state(0))
    assert not [p for p in verify(uri) if p.is_error]
    code, text = _verify_cli(uri, capsys)
    assert code == 0 and "cannot" not in text


def test_plain_dcp_checkpoint_with_an_unknown_extension_is_unsupported_not_corrupt(tmp_path, capsys):
    uri = str(tmp_path / "swapcase")
    _plain_save(uri, [SwapCase()])
    state = _empty()
    with pytest.raises(ckptlib.UnsupportedError, match=r"stored with DCP extension\(s\) stream\.swapcase") as caught:
        ckptlib.load(uri, state)
    assert not isinstance(caught.value, ckptlib.CheckpointCorruptError)
    assert _same(state, _empty())  # refused before anything was read
    notes = [p for p in verify(uri) if "stream.swapcase/1" in p.message]
    assert len(notes) == 1 and notes[0].kind == "note" and "unsupported, not damaged" in notes[0].message
    code, text = _verify_cli(uri, capsys)
    assert code == 0 and "stream.swapcase/1" in text and "cannot be decoded as a tensor" not in text
    dcp.load(state, storage_reader=ckptlib.dcp.reader(uri, extension_registry=_registry()))
    assert _same(state, _state(0))


@pytest.mark.parametrize("extension", ["zstd", "swapcase"])
def test_writer_extensions_are_recorded_as_dcp_records_them(tmp_path, extension):
    uri = str(tmp_path / "ckpt")
    ext = ZStandard() if extension == "zstd" else SwapCase()
    dcp.save(_state(0), storage_writer=ckptlib.dcp.writer(uri, extensions=[ext]))
    registry = _registry()
    state = _empty()
    dcp.load(state, storage_reader=dcp.FileSystemReader(uri, _extension_registry=registry))  # DCP's own reader
    assert _same(state, _state(0))
    state = _empty()
    dcp.load(state, storage_reader=ckptlib.dcp.reader(uri, extension_registry=registry))
    assert _same(state, _state(0))
    if extension == "zstd":
        assert os.path.getsize(tmp_path / "ckpt" / "__0_0.distcp") < 700 * 600 * 4  # compressed
        state = _empty()
        ckptlib.load(uri, state)
        assert _same(state, _state(0)) and verify(uri) == []
    else:
        with pytest.raises(ckptlib.UnsupportedError):
            ckptlib.load(uri, _empty())


def test_damaged_compressed_item_is_caught_by_its_checksum_before_decoding(tmp_path):
    uri = tmp_path / "ckpt"
    dcp.save(_state(0), storage_writer=ckptlib.dcp.writer(str(uri), extensions=[ZStandard()]))
    shard = uri / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(ckptlib.CheckpointCorruptError, match="checksum mismatch"):
        ckptlib.load(str(uri), _empty())
    assert any("checksum mismatch" in p.message for p in verify(str(uri)))


def test_decoding_is_bounded_by_the_declared_size(tmp_path):
    import zstandard

    uri = tmp_path / "bomb"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"b": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(str(uri), _extensions=[ZStandard()]))
    metadata = pickle.loads((uri / ".metadata").read_bytes())
    (index, info), *_ = metadata.storage_data.items()
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB from a few KiB
    (uri / info.relative_path).write_bytes(bomb)
    info.offset, info.length = 0, len(bomb)
    (uri / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ckptlib.CheckpointCorruptError, match="gives more than"):
        ckptlib.load(str(uri), {"b": torch.zeros(4)})


def _save_sharded(uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(_state(0)["w"], mesh, [Shard(0)]), "step": 3}
    dcp.save(state, storage_writer=ckptlib.dcp.writer(uri, extensions=[ZStandard()]))


def _load_sharded(uri: str) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(700, 600), mesh, [Shard(1)]), "step": 0}
    ckptlib.load(uri, state)
    first = torch.equal(state["w"].full_tensor(), _state(0)["w"]) and state["step"] == 3
    state = {"w": distribute_tensor(torch.zeros(700, 600), mesh, [Shard(0)]), "step": 0}
    try:
        dcp.load(state, storage_reader=ckptlib.dcp.reader(uri))
    except CheckpointException as exc:
        raise AssertionError(str(exc)) from exc
    return [first, torch.equal(state["w"].full_tensor(), _state(0)["w"]) and state["step"] == 3]


def test_compressed_shards_reshard(tmp_path, dist_run):
    uri = str(tmp_path / "ckpt")
    dist_run(2, _save_sharded, uri)
    assert verify(uri) == []
    assert dist_run(3, _load_sharded, uri) == [[True, True]] * 3
