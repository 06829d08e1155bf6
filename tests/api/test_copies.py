"""Loads from several copies of a checkpoint (`load(copies=..., info=...)`, the cluster tier's entry
point): each file from the first copy that holds it intact, a warning naming the bad copy and the
next, an error naming every copy tried only when none is left, on every rank; a rank without a
copy of a file gets its items from a rank with one, over the process group."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.copies import damage, node_dirs, shard_files

import ckptlib
from ckptlib.format.read.copies import Copies, Copy
from ckptlib.format.source import inspect_checkpoint
from ckptlib.storage import LocalStorage

NODES = [[0, 1], [2, 3]]


def _state(fill: float) -> dict:
    return {
        "model": {f"w{i}": torch.full((32 + i, 256), fill + i) for i in range(8)},
        "opt": {"param_groups": [{"lr": 0.1 + fill, "params": [0, 1]}], "step": torch.tensor(3.0 + fill)},
        "epoch": 2,
    }


def _exact(state: dict) -> bool:
    expected = _state(0.0)
    return (
        all(torch.equal(state["model"][k], v) for k, v in expected["model"].items())
        and state["opt"]["param_groups"] == expected["opt"]["param_groups"]
        and torch.equal(state["opt"]["step"], expected["opt"]["step"])
        and state["epoch"] == 2
    )


def _local_and_remote(tmp_path) -> tuple[str, str]:
    remote = str(tmp_path / "remote")
    ckptlib.save(remote, _state(0.0))
    local = str(tmp_path / "local")
    shutil.copytree(remote, local)
    return local, remote


# --------------------------------------------------------------------------- one process


def test_a_damaged_local_copy_falls_back_to_the_remote(tmp_path):
    local, remote = _local_and_remote(tmp_path)
    (name,) = shard_files(local)
    damage(os.path.join(local, name))
    state = _state(-1.0)
    copies = [Copy("local", LocalStorage(local)), Copy("remote", LocalStorage(remote))]
    with pytest.warns(ckptlib.CopyFallbackWarning) as caught:
        result = ckptlib.load(local, state, copies=copies)
    assert _exact(state)
    (warning,) = [w for w in caught if issubclass(w.category, ckptlib.CopyFallbackWarning)]
    text = str(warning.message)
    assert f"the local copy {local}/{name} is unusable (checksum mismatch in tensor '" in text
    assert f"from the remote copy {remote}" in text
    assert result.bytes_by_source["remote"] > 0 and result.bytes_by_source["local"] > 0
    assert sum(result.bytes_by_source.values()) == result.storage_bytes_read >= result.bytes_needed


def test_a_missing_local_file_falls_back_and_an_intact_one_reads_only_locally(tmp_path):
    local, remote = _local_and_remote(tmp_path)
    copies = Copies([Copy("local", LocalStorage(local)), Copy("remote", LocalStorage(remote))])
    state = _state(-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptlib.CopyFallbackWarning)
        result = ckptlib.load(local, state, copies=copies)
    assert _exact(state) and set(result.bytes_by_source) == {"local"}

    (name,) = shard_files(local)
    os.remove(os.path.join(local, name))
    state = _state(-1.0)
    with pytest.warns(ckptlib.CopyFallbackWarning, match=f"the local copy {local}/{name} is unusable \\(missing\\)"):
        result = ckptlib.load(local, state, copies=copies)
    assert _exact(state) and result.bytes_by_source == {"remote": result.bytes_needed}


def test_every_copy_bad_names_the_file_and_every_copy(tmp_path):
    local, remote = _local_and_remote(tmp_path)
    (name,) = shard_files(local)
    damage(os.path.join(local, name))
    os.remove(os.path.join(remote, name))
    copies = [Copy("local", LocalStorage(local)), Copy("remote", LocalStorage(remote))]
    with pytest.warns(ckptlib.CopyFallbackWarning), pytest.raises(ckptlib.CopiesExhaustedError) as raised:
        ckptlib.load(local, _state(-1.0), copies=copies)
    err = raised.value
    assert isinstance(err, ckptlib.CheckpointCorruptError) and not isinstance(err, ckptlib.CheckpointNotFoundError)
    assert (
        f"every copy of {name} (rank 0's shard) failed: local {local}/{name}: checksum mismatch in tensor 'model."
        in str(err)
    )
    assert f"; remote {remote}/{name}: missing" in str(err)
    assert err.file == name and [t[0] for t in err.tried] == ["local", "remote"]

    os.remove(os.path.join(local, name))
    with pytest.warns(ckptlib.CopyFallbackWarning), pytest.raises(ckptlib.CopiesMissingError) as raised:
        ckptlib.load(local, _state(-1.0), copies=copies)
    assert isinstance(raised.value, ckptlib.CheckpointNotFoundError)
    assert isinstance(raised.value, ckptlib.CheckpointCorruptError)


def test_copies_per_file_and_info_as_bytes(tmp_path):
    """The per-file form of copies, a copy without the manifest and `.metadata` (they come as
    bytes read elsewhere), and bad bytes for them refused with the usual errors."""
    local, remote = _local_and_remote(tmp_path)
    for name in ("ckptlib.json", ".metadata"):
        os.remove(os.path.join(local, name))
    (shard,) = shard_files(local)
    info = (
        open(os.path.join(remote, "ckptlib.json"), "rb").read(),
        open(os.path.join(remote, ".metadata"), "rb").read(),
    )
    state = _state(-1.0)
    named = str(tmp_path / "nowhere" / "step-2")  # with copies, `uri` only names the checkpoint
    result = ckptlib.load(named, state, copies={shard: [("local", LocalStorage(local))]}, info=info)
    assert _exact(state) and result.bytes_by_source == {"local": result.bytes_needed}
    assert result.uri == named and not os.path.exists(named)

    state = _state(-1.0)
    given = inspect_checkpoint(remote)
    ckptlib.load(local, state, copies=[Copy("local", LocalStorage(local), files={shard})], info=given)
    assert _exact(state)

    bad = (info[0], info[1][:-1] + bytes([info[1][-1] ^ 1]))
    with pytest.raises(ckptlib.CheckpointCorruptError, match=r"\.metadata: checksum mismatch"):
        ckptlib.load(local, _state(-1.0), copies=[Copy("local", LocalStorage(local))], info=bad)


def test_without_info_the_manifest_comes_from_the_next_copy(tmp_path):
    local, remote = _local_and_remote(tmp_path)
    os.remove(os.path.join(local, "ckptlib.json"))
    state = _state(-1.0)
    copies = [Copy("local", LocalStorage(local)), Copy("remote", LocalStorage(remote))]
    with pytest.warns(
        ckptlib.CopyFallbackWarning, match=f"reading the checkpoint's manifest from the remote copy {remote}"
    ):
        result = ckptlib.load(local, state, copies=copies)
    assert _exact(state) and set(result.bytes_by_source) == {"local"}  # the shard itself is intact locally


# --------------------------------------------------------------------------- 2 nodes x 2 ranks


def _node_load(base: str, spec: str) -> dict:
    """Load from node-local copies: rank r's node holds its ranks' shard files (`spec`
    "remote": every rank also has the remote, the saved directory; "replica": node 1 also
    holds node 0's files, node 0's own are damaged; "none": node 1 holds nothing of node 0's
    files and node 0 lost them)."""
    node = dist.get_rank() // 2
    local = os.path.join(base, f"node{node}")
    copies = [Copy("local", LocalStorage(local), files=set(os.listdir(local)))]
    if spec == "remote":
        copies.append(Copy("remote", LocalStorage(os.path.join(os.path.dirname(base), "saved"))))
    if spec == "replica" and node == 1:
        replica = os.path.join(base, "replica1")
        copies.append(Copy("replica", LocalStorage(replica), files=set(os.listdir(replica))))
    state = _state(-1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ckptlib.load(local, state, copies=copies)
        except ckptlib.CheckpointError as exc:
            return {"error": type(exc).__name__, "text": str(exc)}
    return {
        "exact": _exact(state),
        "read": result.storage_bytes_read,
        "sum": sum(result.storage_bytes_read_by_rank),
        "by_rank": result.storage_bytes_read_by_rank,
        "needed": result.bytes_needed,
        "received": result.bytes_received,
        "by_source": result.bytes_by_source,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ckptlib.CopyFallbackWarning)],
    }


def _save_on_four(path: str) -> None:
    ckptlib.save(path, _state(0.0))


def _split(tmp_path, dist_run) -> tuple[str, str]:
    saved = str(tmp_path / "saved")
    dist_run(4, _save_on_four, saved, timeout=120)
    base = str(tmp_path / "nodes")
    node_dirs(saved, base, NODES)
    assert shard_files(os.path.join(base, "node1")), "the test needs items in node 1's files"
    return saved, base


def test_each_node_reads_its_own_files_and_the_others_receive_them(tmp_path, dist_run):
    _, base = _split(tmp_path, dist_run)
    results = dist_run(4, _node_load, base, "local", timeout=120)
    assert all(r.get("exact") for r in results), results
    needed = results[0]["needed"]
    assert needed <= results[0]["sum"] <= 1.1 * needed
    assert all(r["by_source"] == {"local": results[0]["sum"]} for r in results)
    assert all(r["received"] > 0 for r in results) and all(r["warnings"] == [] for r in results)
    # what `ckpt plan` predicts from the ranks' plans and copies is what they read
    assert _predicted(base).storage_bytes() == results[0]["by_rank"]


def _predicted(base: str):
    from ckptlib.format import SafeLoadPlanner
    from ckptlib.format.read.copies import open_from_copies
    from ckptlib.format.read.read_schedule import predict_reads

    metadata = open_from_copies(Copies.single(LocalStorage(os.path.join(base, "node0")))).metadata
    plans, copies = [], []
    for rank in range(4):
        planner = SafeLoadPlanner()
        planner.set_up_planner(_state(-1.0), metadata, rank == 0)
        plans.append(planner.create_local_plan())
        local = os.path.join(base, f"node{rank // 2}")
        copies.append(Copies([Copy("local", LocalStorage(local), files=set(os.listdir(local)))]))
    return predict_reads(plans, metadata, copies=copies)


def test_with_a_remote_too_nothing_is_read_from_it_while_nodes_hold_every_file(tmp_path, dist_run):
    _, base = _split(tmp_path, dist_run)
    results = dist_run(4, _node_load, base, "remote", timeout=120)
    assert all(r.get("exact") for r in results), results
    assert all(r["by_source"] == {"local": results[0]["sum"]} for r in results)
    # node 0 lost its files: those come from the remote, once, and reach every rank
    for name in shard_files(os.path.join(base, "node0")):
        os.remove(os.path.join(base, "node0", name))
    results = dist_run(4, _node_load, base, "remote", timeout=120)
    assert all(r.get("exact") for r in results), results
    remote = sum(
        os.path.getsize(os.path.join(tmp_path, "saved", n)) for n in shard_files(str(tmp_path / "saved"), [0, 1])
    )
    assert 0 < results[0]["by_source"]["remote"] <= remote and results[0]["sum"] <= 1.1 * results[0]["needed"]


def test_a_damaged_node_copy_is_read_from_a_peer_replica(tmp_path, dist_run):
    saved, base = _split(tmp_path, dist_run)
    node_dirs(saved, os.path.join(base, "r"), [NODES[0]], common=False)
    os.rename(os.path.join(base, "r", "node0"), os.path.join(base, "replica1"))
    for name in shard_files(os.path.join(base, "node0")):
        damage(os.path.join(base, "node0", name))
    results = dist_run(4, _node_load, base, "replica", timeout=180)
    assert all(r.get("exact") for r in results), results
    assert all(r["by_source"].get("replica", 0) > 0 for r in results)
    # node 0 found its own copy bad: every rank was told, and the load ran again from the replica
    assert all(any("loading again" in w and "every copy of __0_0.distcp" in w for w in r["warnings"]) for r in results)


def test_no_copy_left_anywhere_fails_every_rank_naming_it(tmp_path, dist_run):
    saved, base = _split(tmp_path, dist_run)
    for name in shard_files(os.path.join(base, "node0")):
        os.remove(os.path.join(base, "node0", name))
    results = dist_run(4, _node_load, base, "none", timeout=120)
    assert [r.get("error") for r in results] == ["NoCopyError"] * 4, results
    assert len({r["text"] for r in results}) == 1
    assert (
        "no rank of this load has a copy of __0_0.distcp (rank 0's shard), which ranks 0, 1, 2, 3 need"
        in (results[0]["text"])
    )


def test_every_copy_damaged_fails_every_rank_naming_each_copy(tmp_path, dist_run):
    saved, base = _split(tmp_path, dist_run)
    node_dirs(saved, os.path.join(base, "r"), [NODES[0]], common=False)
    os.rename(os.path.join(base, "r", "node0"), os.path.join(base, "replica1"))
    for where in ("node0", "replica1"):
        for name in shard_files(os.path.join(base, where)):
            damage(os.path.join(base, where, name))
    results = dist_run(4, _node_load, base, "replica", timeout=180)
    assert [r.get("error") for r in results] == ["CopiesExhaustedError"] * 4, results
    text = results[0]["text"]
    assert all(r["text"] == text for r in results)
    assert "every copy of __0_0.distcp (rank 0's shard) failed" in text
    assert f"local {base}/node0/__0_0.distcp: checksum mismatch" in text
    assert f"replica {base}/replica1/__0_0.distcp: checksum mismatch" in text


def _bad_copies_on_rank_1(path: str) -> tuple:
    copies = [Copy("local", LocalStorage(path))] if dist.get_rank() != 1 else ["not a copy"]
    try:
        ckptlib.load(path, _state(-1.0), copies=copies)
    except ckptlib.CheckpointError as exc:
        return type(exc).__name__, exc.rank, "copies=: expected Copy(label, storage" in str(exc)
    return ("ok",)


def test_bad_copies_on_one_rank_fail_every_rank(tmp_path, dist_run):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(0.0))
    assert dist_run(2, _bad_copies_on_rank_1, path, timeout=90) == [("StorageError", 1, True)] * 2
