"""Damage in every kind of zip record of a shard, for whole and for partial (resharded) reads.

A shard item is a torch.save zip archive: local headers and payloads of ``data.pkl``,
``byteorder``, the tensor's ``data/0``, ``version`` and ``.data/serialization_id``, then the
central directory and its end record. The file here is one item of 4.3 MiB, so its checksum
blocks are four full 1 MiB blocks and a last, *short* block holding the last rows, the central
directory and the end record; a rank that needs half the rows reads and verifies only the
blocks that hold them and the records that locate them.

The rule every case checks: a verified load never returns wrong values. It either raises
CheckpointCorruptError naming the file, or (a partial read that did not touch the damaged
bytes) returns the exact rows; and ``ckpt verify`` always reports the damage.
"""

from __future__ import annotations

import pytest
import torch

import ckptlib
from ckptlib import CheckpointCorruptError, cli

ROWS, COLS = 1100, 1024  # 4.3 MiB of float32: four full 1 MiB blocks and a short last block
HALF = ROWS // 2
SHARD = "__0_0.distcp"


def _weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))


def _records(data: bytes) -> dict[str, tuple[int, int]]:
    """{kind: (header offset, payload offset)} of the local records, plus the central
    directory entries and the end record, found by their signatures and names."""
    found: dict[str, tuple[int, int]] = {}
    pos = data.find(b"PK\x03\x04")
    while pos != -1:
        name_len = int.from_bytes(data[pos + 26 : pos + 28], "little")
        extra_len = int.from_bytes(data[pos + 28 : pos + 30], "little")
        name = data[pos + 30 : pos + 30 + name_len].decode("utf-8", "replace")
        kind = name.rsplit("/", 1)[-1] if "/data/" not in name else "data/" + name.rsplit("/", 1)[-1]
        if name.endswith(".data/serialization_id"):
            kind = "serialization_id"
        found.setdefault(kind, (pos, pos + 30 + name_len + extra_len))
        pos = data.find(b"PK\x03\x04", pos + 4)
    central = data.find(b"PK\x01\x02")
    found["central_directory"] = (central, central + 46)
    end = data.rfind(b"PK\x05\x06")
    found["end_of_central_directory"] = (end, end + 22)
    return found


def _damage_at(data: bytes, where: str) -> int:
    records = _records(data)
    if where == "rows-last-block":
        _, payload = records["data/0"]
        return payload + ROWS * COLS * 4 - 100  # inside the last row, in the file's short last block
    if where == "rows-first-block":
        _, payload = records["data/0"]
        return payload + 10 * COLS * 4 + 7
    kind, part = where.rsplit(":", 1)
    header, payload = records[kind]
    return header + 1 if part == "header" else payload


WHERE = [
    "rows-last-block",
    "rows-first-block",
    "data.pkl:header",
    "data.pkl:payload",
    "byteorder:header",
    "data/0:header",
    "version:header",
    "serialization_id:header",
    "central_directory:header",
    "end_of_central_directory:header",
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("damage") / "ckpt"
    ckptlib.save(str(path), {"w": _weight()})
    data = (path / SHARD).read_bytes()
    assert len(data) % (1 << 20) and len(data) > (1 << 20)  # a short last block exists
    return path, data


def _damaged_copy(saved, tmp_path, where: str):
    path, data = saved
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    at = _damage_at(data, where)
    damaged = bytearray(data)
    damaged[at] ^= 0x5A
    (copy / SHARD).write_bytes(bytes(damaged))
    return copy, at


def _partial_load(uri: str, verify: bool):
    """Rank r of 2 loads rows [HALF r, HALF (r + 1)) of w: rank 1's rows end in the short last block."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])}
    try:
        ckptlib.load(uri, state, verify=verify)
    except CheckpointCorruptError as exc:
        return ("corrupt", str(exc))
    rank = dist.get_rank()
    exact = torch.equal(state["w"].to_local(), _weight()[rank * HALF : (rank + 1) * HALF])
    return ("loaded", exact)


def _verify_exit(path) -> int:
    return cli.main(["verify", "--no-progress", str(path)])


@pytest.mark.parametrize("where", WHERE)
def test_whole_read_refuses_damage_in_every_record(saved, tmp_path, where):
    copy, _ = _damaged_copy(saved, tmp_path, where)
    with pytest.raises(CheckpointCorruptError, match=SHARD):
        ckptlib.load(str(copy), {"w": torch.zeros(ROWS, COLS)})
    assert _verify_exit(copy) == 1


@pytest.mark.parametrize("where", WHERE)
def test_partial_read_never_returns_damaged_rows(saved, tmp_path, where, dist_run):
    copy, at = _damaged_copy(saved, tmp_path, where)
    results = dist_run(2, _partial_load, str(copy), True)
    for rank, (outcome, detail) in enumerate(results):
        if outcome == "corrupt":
            assert SHARD in detail, detail
        else:
            assert detail is True, f"rank {rank} loaded wrong rows after damage at byte {at} ({where})"
    if where == "rows-last-block":
        # rank 1's rows end in the short last block: its block check must see the damage
        last = len(saved[1]) // (1 << 20)
        assert results[1][0] == "corrupt" and f": file block {last} (bytes " in results[1][1], results
    assert _verify_exit(copy) == 1
