"""The decisions of `ckptlib.manager.cluster.damaged`, single process (the 4-rank runs are in
tests/manager/test_tier_damaged_copies.py): which node's copy a load's unusable copies name
(local copies only, by the key's node), which files are set aside (only those the manifest
lists and that still do not match it; renamed, never deleted, on a directory root), and how an
upload's assignment moves a damaged file (to the least busy rank of the lowest other node
holding it, off the rank that failed; an error when no copy is left)."""

from __future__ import annotations

import os
import warnings
import zlib

import pytest

from ckptlib.errors import CopyFallbackWarning, DamagedCopyError
from ckptlib.format.native.manifest import FileRecord, Manifest
from ckptlib.loading.loading import UnusableCopy
from ckptlib.manager.cluster.damaged import DAMAGED_SUFFIX, damaged_by_node, node_key, reassign, set_aside, without
from ckptlib.manager.cluster.topology import Topology
from ckptlib.storage import open_storage

# 3 nodes of 2 ranks: node 0 = ranks 0, 1; node 1 = 2, 3; node 2 = 4, 5
TOPOLOGY = Topology(0, ((0, 1), (2, 3), (4, 5)))


def _copy(key: str, file: str, label: str = "local") -> UnusableCopy:
    return UnusableCopy(key, file, label, f"/somewhere/{file}", "short")


def test_the_unusable_local_copies_name_their_nodes():
    unusable = [
        _copy(node_key(0, "/n0/step_1"), "a"),
        _copy(node_key(2, "/other/path/step_1"), "b"),  # each node's root may sit elsewhere
        _copy(node_key(2, "/other/path/step_1"), "c"),
        _copy(node_key(1, "/n1/step_1"), "d", label="replica"),  # a replica: not the node's own copy
        _copy("remote:s3://b/step_1", "e", label="remote"),
        _copy(node_key(7, "/n7/step_1"), "f"),  # a node this topology does not have
    ]
    assert damaged_by_node(unusable, TOPOLOGY) == {0: frozenset({"a"}), 2: frozenset({"b", "c"})}
    assert damaged_by_node([], TOPOLOGY) == {}


def _step(tmp_path, files: dict[str, bytes]):
    root = tmp_path / "step_0000000001"
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return open_storage(str(root)), root


def _manifest(files: dict[str, bytes]) -> Manifest:
    return Manifest(world_size=2, files={n: FileRecord(len(d), zlib.crc32(d)) for n, d in files.items()})


GOOD = {"__0_0.distcp": b"rank zero's bytes" * 10, "__1_0.distcp": b"rank one's bytes" * 10}


def test_an_intact_copy_stays(tmp_path):
    storage, root = _step(tmp_path, GOOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set_aside(storage, "__0_0.distcp", _manifest(GOOD)) is False
    assert sorted(os.listdir(root)) == sorted(GOOD)


@pytest.mark.parametrize("damage", ["flipped", "short", "empty"])
def test_a_damaged_copy_is_renamed_aside_and_reported(tmp_path, damage):
    data = bytearray(GOOD["__1_0.distcp"])
    if damage == "flipped":
        data[5] ^= 1
    elif damage == "short":
        data = data[:-1]
    else:
        data = bytearray()
    storage, root = _step(tmp_path, {**GOOD, "__1_0.distcp": bytes(data)})
    with pytest.warns(CopyFallbackWarning) as caught:
        assert set_aside(storage, "__1_0.distcp", _manifest(GOOD)) is True
    assert sorted(os.listdir(root)) == ["__0_0.distcp", "__1_0.distcp" + DAMAGED_SUFFIX]
    assert (root / ("__1_0.distcp" + DAMAGED_SUFFIX)).read_bytes() == bytes(data)  # set aside, not deleted
    assert str(caught[0].message) == (
        f"{root}/__1_0.distcp does not match its manifest: set aside as __1_0.distcp.damaged "
        "(no later load, replica or upload of the tier reads it)"
    )


def test_a_missing_copy_is_unusable_and_nothing_is_touched(tmp_path):
    storage, root = _step(tmp_path, {"__0_0.distcp": GOOD["__0_0.distcp"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set_aside(storage, "__1_0.distcp", _manifest(GOOD)) is True
    assert os.listdir(root) == ["__0_0.distcp"]


def test_a_file_the_manifest_does_not_list_is_never_touched(tmp_path):
    storage, root = _step(tmp_path, {**GOOD, "notes.txt": b"the user's"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set_aside(storage, "notes.txt", _manifest(GOOD)) is False
    assert (root / "notes.txt").read_bytes() == b"the user's"


def test_without_drops_only_the_damaged_copies():
    holders = {0: frozenset({"a", "b"}), 1: frozenset({"a", "b"}), 2: frozenset({"c"})}
    assert without(holders, {0: frozenset({"a"}), 2: frozenset({"x"})}) == {
        0: frozenset({"b"}),
        1: frozenset({"a", "b"}),
        2: frozenset({"c"}),
    }


def _damaged(rank: int, file: str) -> DamagedCopyError:
    return DamagedCopyError(f"{file} on rank {rank} is damaged", file=file, rank=rank)


def test_a_damaged_file_moves_to_the_least_busy_rank_of_the_lowest_other_node_holding_it():
    # rank 3 (node 1) found "f" damaged; nodes 0 and 2 hold it too: node 0, whose rank 1 is least busy
    assignment = {0: ["x", "y"], 1: ["z"], 3: ["f", "w"], 4: []}
    holders = {0: frozenset({"f", "x"}), 1: frozenset({"f", "w"}), 2: frozenset({"f"})}
    out, left = reassign(_damaged(3, "f"), assignment, holders, TOPOLOGY)
    assert out == {0: ["x", "y"], 1: ["z", "f"], 3: ["w"], 4: []}
    assert left == {0: frozenset({"f", "x"}), 1: frozenset({"w"}), 2: frozenset({"f"})}
    assert assignment == {0: ["x", "y"], 1: ["z"], 3: ["f", "w"], 4: []}  # the caller's is untouched


def test_a_tie_goes_to_the_lowest_rank_and_a_rank_with_nothing_counts_as_least_busy():
    out, _ = reassign(
        _damaged(0, "f"), {0: ["f"], 2: ["p"], 3: ["q"]}, {0: frozenset({"f"}), 1: frozenset({"f"})}, TOPOLOGY
    )
    assert out == {0: [], 2: ["p", "f"], 3: ["q"]}
    out, _ = reassign(_damaged(0, "f"), {0: ["f"], 2: ["p"]}, {0: frozenset({"f"}), 1: frozenset({"f"})}, TOPOLOGY)
    assert out == {0: [], 2: ["p"], 3: ["f"]}


def test_the_node_is_the_damaged_rank_s_not_the_rank_number():
    # rank 2 is on node 1: node 1's copy is out, node 2's (the only other) is used
    holders = {0: frozenset(), 1: frozenset({"f"}), 2: frozenset({"f"})}
    out, left = reassign(_damaged(2, "f"), {2: ["f"]}, holders, TOPOLOGY)
    assert out == {2: [], 4: ["f"]} and left[1] == frozenset() and left[2] == frozenset({"f"})


def test_no_other_copy_left_raises_the_damaged_copy_error():
    err = _damaged(4, "f")
    with pytest.raises(DamagedCopyError) as info:
        reassign(err, {4: ["f"]}, {0: frozenset({"g"}), 2: frozenset({"f"})}, TOPOLOGY)
    assert info.value is err and info.value.file == "f" and info.value.rank == 4
