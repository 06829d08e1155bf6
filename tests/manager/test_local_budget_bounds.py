"""The local budget's figures and bounds, single process (the 4-rank runs are in
tests/manager/test_local_budget.py): a save that reaches the limit or the free space exactly
still fits and one byte more is refused with the exact message naming the bound it passes;
each node is judged on its leader's figures and the newest step's actual bytes (the state's
bytes times 1 + replicas only for the first save); a root held in memory is checked against its
free space even without a limit; a sparse file counts the blocks it holds; a tensor held twice
counts once."""

from __future__ import annotations

import os
import tempfile
import types

import pytest
import torch
from torch import nn

from ckptlib import LocalLimitError
from ckptlib.loading.read_cost import filesystem_type
from ckptlib.manager import local_budget
from ckptlib.manager.local_budget import LocalBudget, LocalUsage, check, entry_bytes, state_bytes
from ckptlib.storage import open_storage

ROOT = "/roots/node"


def _report(held: int, limit: int | None, free: int | None, newest: int = 0, fs: str = "tmpfs") -> LocalUsage:
    return LocalUsage(ROOT, held, newest, limit, free, fs)


@pytest.mark.parametrize(("need", "fits"), [(399, True), (400, True), (401, False)], ids=["under", "exactly", "over"])
def test_the_limit_admits_exactly_its_bytes(need, fits):
    report = _report(held=600, limit=1000, free=None)
    if fits:
        check(3, report, need)
        return
    with pytest.raises(LocalLimitError) as info:
        check(3, report, need)
    assert str(info.value) == (
        f"node 3: a save would need about 401 more bytes in {ROOT!r}, which holds 600: past max_local_bytes=1000; "
        "nothing was written (keep fewer steps, raise the limit, or give the root more space)"
    )
    err = info.value
    assert (err.node, err.held, err.need, err.limit, err.path) == (3, 600, 401, 1000, ROOT)


@pytest.mark.parametrize(("need", "fits"), [(499, True), (500, True), (501, False)], ids=["under", "exactly", "over"])
def test_the_free_space_admits_exactly_its_bytes(need, fits):
    report = _report(held=10_000, limit=None, free=500)
    if fits:
        check(0, report, need)
        return
    with pytest.raises(LocalLimitError) as info:
        check(0, report, need)
    assert str(info.value) == (
        f"node 0: a save would need about 501 more bytes in {ROOT!r}, which holds 10000: past the 500 bytes free on "
        "its tmpfs; nothing was written (keep fewer steps, raise the limit, or give the root more space)"
    )
    assert info.value.limit is None


@pytest.mark.parametrize(
    ("limit", "free", "bound"),
    [
        (1000, 10**9, "past max_local_bytes=1000;"),
        (10**9, 300, "past the 300 bytes free on its tmpfs;"),
        (1000, 300, "past max_local_bytes=1000;"),  # past both: the limit is named
    ],
    ids=["limit", "free", "both"],
)
def test_the_error_names_the_bound_passed(limit, free, bound):
    with pytest.raises(LocalLimitError) as info:
        check(1, _report(held=900, limit=limit, free=free), 400)
    assert bound in str(info.value), str(info.value)


def test_an_unknown_filesystem_is_named_as_such():
    with pytest.raises(LocalLimitError, match="past the 5 bytes free on its filesystem;"):
        check(0, _report(held=0, limit=None, free=5, fs=""), 6)


def _budget(path: str, limit: int | None) -> LocalBudget:
    return LocalBudget(limit, open_storage(path))


NODES = types.SimpleNamespace(nodes=((0, 1), (2, 3)))


def _rows(rows: list[list[int]], limit: int | None) -> list[list[int]]:
    """Every rank's `LocalBudget.figures` for a bounded root: [1, rank bytes, held, newest, free,
    limit] from [rank bytes, held, newest, free] (each node is judged on its leader's limit)."""
    return [[1, *row, -1 if limit is None else limit] for row in rows]


def test_each_node_is_judged_on_its_leader_s_figures(tmp_path):
    budget = _budget(str(tmp_path), 1000)
    rows = [[100, 0, 0, -1], [100, 0, 0, -1], [100, 700, 400, -1], [100, 0, 0, -1]]  # node 1's leader is rank 2
    with pytest.raises(LocalLimitError) as info:
        budget.check(_rows(rows, 1000), NODES, replicas=1)
    assert (info.value.node, info.value.held, info.value.need, info.value.limit) == (1, 700, 400, 1000)
    assert str(info.value).startswith("node 1: a save would need about 400 more bytes in ")


@pytest.mark.parametrize(("replicas", "need"), [(0, 200), (1, 400), (2, 600)])
def test_the_first_save_needs_the_node_s_state_bytes_times_one_plus_replicas(tmp_path, replicas, need):
    budget = _budget(str(tmp_path), need - 1)
    rows = [[60, 0, 0, -1], [140, 0, 0, -1], [1, 0, 0, -1], [1, 0, 0, -1]]
    with pytest.raises(LocalLimitError) as info:
        budget.check(_rows(rows, need - 1), NODES, replicas=replicas)
    assert (info.value.node, info.value.need) == (0, need)
    _budget(str(tmp_path), need).check(_rows(rows, need), NODES, replicas=replicas)  # exactly: fits


def test_a_later_save_needs_the_newest_step_s_actual_bytes(tmp_path):
    rows = [[10**6, 0, 300, -1], [10**6, 0, 0, -1], [1, 0, 300, -1], [1, 0, 0, -1]]  # the state estimate is far larger
    _budget(str(tmp_path), 300).check(_rows(rows, 300), NODES, replicas=1)
    with pytest.raises(LocalLimitError) as info:
        _budget(str(tmp_path), 299).check(_rows(rows, 299), NODES, replicas=1)
    assert info.value.need == 300


def test_a_root_on_disk_without_a_limit_adds_no_figures(tmp_path):
    if filesystem_type(str(tmp_path)) in local_budget.MEMORY_FILESYSTEMS:
        pytest.skip("the temporary directory is itself in memory here")
    budget = _budget(str(tmp_path), None)
    assert not budget.active and budget.figures(True, {"w": torch.ones(4)}) == [0, 0, 0, 0, -1, -1]
    budget.check([[0, 10**12, 0, 0, 1, -1]], types.SimpleNamespace(nodes=((0,),)), replicas=1)  # not bounded


@pytest.mark.skipif(
    not os.path.isdir("/dev/shm") or filesystem_type("/dev/shm") != "tmpfs", reason="/dev/shm is not a tmpfs here"
)
def test_a_root_in_memory_is_checked_against_its_free_space_without_a_limit():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        budget = _budget(root, None)
        assert budget.active and budget.filesystem == "tmpfs"
        figures = budget.figures(True, {"w": torch.ones(4), "v": torch.ones(2, dtype=torch.float64)})
        assert figures[:4] == [1, 32, 0, 0] and figures[4] > 0 and figures[5] == -1
        assert budget.figures(False, {}) == [1, 32, 0, 0, -1, -1]  # counted once; a non-leader sends no root figures
        one = types.SimpleNamespace(nodes=((0,),))
        budget.check([[1, 50, 0, 0, 100, -1]], one, replicas=1)  # 100 bytes: fits exactly
        with pytest.raises(LocalLimitError, match="past the 100 bytes free on its tmpfs;"):
            budget.check([[1, 51, 0, 0, 100, -1]], one, replicas=1)


def test_a_sparse_file_counts_the_blocks_it_holds(tmp_path):
    step = tmp_path / "step_0000000001"
    step.mkdir()
    with open(step / "sparse", "wb") as f:
        f.truncate(64 << 20)  # 64 MiB long, nothing written
        f.write(b"x" * 4096)
    (step / "dense").write_bytes(b"y" * 10_000)
    (tmp_path / "top").write_bytes(b"z" * 100)
    sizes = entry_bytes(str(tmp_path))
    blocks = {name: os.lstat(step / name).st_blocks * 512 for name in ("sparse", "dense")}
    assert sizes == {
        "step_0000000001": blocks["sparse"] + blocks["dense"],
        "top": os.lstat(tmp_path / "top").st_blocks * 512,
    }
    assert sizes["step_0000000001"] < 1 << 20  # not the sparse file's 64 MiB length
    assert entry_bytes(str(tmp_path / "absent")) == {}


def test_a_tensor_held_twice_counts_once():
    shared = torch.ones(10)  # 40 bytes
    tied = nn.Linear(4, 4, bias=False)  # 64 bytes
    state = {"a": shared, "b": [shared, {"again": shared}], "model": tied, "same": tied.weight, "step": 3}
    assert state_bytes(state) == 40 + 64
    assert state_bytes({"x": torch.zeros(3, dtype=torch.bfloat16), "y": torch.zeros(2, 2, dtype=torch.int64)}) == 6 + 32


def test_tied_weights_count_once_and_every_module_counts():
    lm = nn.Module()
    lm.embed = nn.Embedding(100, 8)  # 3200 bytes
    lm.head = nn.Linear(8, 100, bias=False)
    lm.head.weight = lm.embed.weight  # tied: one parameter under two keys of the state_dict
    assert state_bytes({"model": lm}) == 3200
    modules = {f"m{i}": nn.Linear(4, 4, bias=False) for i in range(20)}  # 64 bytes each, none shared
    assert state_bytes(modules) == 20 * 64
    whole = torch.zeros(4, 4)
    assert state_bytes({"a": whole[0], "b": whole[1], "c": whole[0]}) == 16 + 16  # two rows, one twice
