"""The in-memory tier (issue 34, item 3): node roots on tmpfs (`ckptlib.memory_root`) with
`replicas=1`, bounded by `Cluster(max_local_bytes=...)` and reported by `local_usage()`.

- `memory_root` is refused on a filesystem that is not memory, with the path and its type;
- on 2 simulated nodes (`dist_run(nodes=2)`), a save that would take a node past the limit is
  a LocalLimitError on every rank naming the node and the figures, before anything is
  written: the committed steps, `latest` and every file stay exactly as they were; the first
  save is judged from the state's bytes; `local_usage()` reports what each root holds;
- a node root lost with its host: the job resumes from the peer's memory at another world
  size, bit for bit.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from ckptlib import Cluster, LocalLimitError, StateError, UnsupportedError, memory_root
from ckptlib.loading.read_cost import filesystem_type

SHM = "/dev/shm"
needs_shm = pytest.mark.skipif(
    not os.path.isdir(SHM) or filesystem_type(SHM) != "tmpfs", reason="/dev/shm is not a tmpfs here"
)


@pytest.fixture
def shm_base():
    """A fresh directory on /dev/shm (the node roots live in memory), removed afterwards."""
    base = tempfile.mkdtemp(prefix="ckptlib-test-", dir=SHM)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@needs_shm
def test_memory_root_is_a_directory_on_tmpfs(shm_base):
    path = memory_root("job-7", base=shm_base)
    assert path == os.path.join(shm_base, "ckptlib", "job-7") and os.path.isdir(path)
    assert os.stat(path).st_mode & 0o777 == 0o700 and filesystem_type(path) == "tmpfs"


def test_memory_root_refuses_a_disk_and_a_bad_job_name(tmp_path):
    kind = filesystem_type(str(tmp_path))
    if kind in ("tmpfs", "ramfs"):
        pytest.skip("the temporary directory is itself in memory here")
    with pytest.raises(UnsupportedError) as caught:
        memory_root("job", base=str(tmp_path))
    assert str(caught.value).startswith(
        f"{str(tmp_path)!r} is not a memory filesystem ({kind or 'missing or unknown'})"
    )
    assert not os.path.exists(tmp_path / "ckptlib")  # nothing created
    for job in ("", "a/b", ".."):
        with pytest.raises(StateError, match="memory_root's job must be a plain name"):
            memory_root(job, base=SHM)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1G"])
def test_max_local_bytes_must_be_a_positive_int(bad):
    with pytest.raises(StateError, match=r"max_local_bytes must be a positive int \(bytes\) or None, got "):
        Cluster(replicas=1, max_local_bytes=bad)


ROWS, COLS = 64, 64  # 16 KiB of float32, 4 KiB a rank at 4 ranks


def _state(step: int, zero: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(step)
    full = torch.zeros(ROWS, COLS) if zero else torch.randn(ROWS, COLS, generator=gen)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": -1 if zero else step}


def _root(base: str) -> str:
    return os.path.join(base, f"node{os.environ['GROUP_RANK']}")


def _files(root: str) -> dict[str, int]:
    """Every file under `root` and its size, but the lock (the leader takes it during a save)."""
    out = {}
    for parent, _dirs, names in os.walk(root):
        for name in names:
            if name == "ckptlib.lock":
                continue
            path = os.path.join(parent, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


def _save_until_refused(base: str, limit_steps: float) -> dict:
    """Save steps 1, 2, ... with keep_last=10 under a limit of `limit_steps` steps' bytes (learnt
    from step 1): the save that would pass it raises; the root is as before it."""
    import ckptlib

    probe = ckptlib.CheckpointManager(_root(base) + "-probe", cluster=Cluster(replicas=1))
    probe.save(1, _state(1))
    probe.wait()
    step_bytes = probe.local_usage().newest_step_bytes
    probe.close()
    limit = int(step_bytes * limit_steps)
    mgr = ckptlib.CheckpointManager(_root(base), keep_last=10, cluster=Cluster(replicas=1, max_local_bytes=limit))
    saved, error, before = [], None, None
    import torch.distributed as dist

    for step in range(1, 10):
        dist.barrier()  # the previous save is over on every rank
        before = _files(_root(base))
        try:
            mgr.save(step, _state(step))
            mgr.wait()
        except LocalLimitError as exc:
            error = exc
            break
        saved.append(step)
    import torch.distributed as dist

    dist.barrier()  # every rank's refusal is over (the leader released its lock)
    usage = mgr.local_usage()
    after = _files(_root(base))
    state = _state(0, zero=True)
    resumed = mgr.load(state)
    equal = torch.equal(state["w"].full_tensor(), _state(resumed)["w"].full_tensor())
    mgr.close()
    return {
        "saved": saved,
        "error": None if error is None else (type(error).__name__, str(error), error.node, error.need, error.limit),
        "unchanged": before == after,
        "usage": (usage.held_bytes, usage.newest_step_bytes, usage.limit_bytes, usage.filesystem, usage.in_memory),
        "step_bytes": step_bytes,
        "limit": limit,
        "held_files": sum(os.stat(os.path.join(_root(base), p)).st_blocks * 512 for p in after),
        "resumed": (resumed, equal),
    }


@needs_shm
def test_a_save_past_the_limit_is_refused_on_every_rank_before_anything_is_written(shm_base, dist_run):
    results = dist_run(4, _save_until_refused, shm_base, 2.5, nodes=2)
    first = results[0]
    assert first["saved"] == [1, 2], first  # two steps fit in 2.5 steps' bytes, the third does not
    for r in results:
        assert r["saved"] == [1, 2] and r["unchanged"], r  # every rank refused; nothing was written
        name, text, node, need, limit = r["error"]
        assert name == "LocalLimitError" and limit == first["limit"] and need == first["step_bytes"], r["error"]
        assert f"a save would need about {need} more bytes in " in text and f"past max_local_bytes={limit}" in text
        assert text.startswith(f"node {node}: ") and "nothing was written" in text, text
        held, newest, usage_limit, fs, in_memory = r["usage"]
        assert (held, newest, usage_limit, fs, in_memory) == (
            r["held_files"],
            first["step_bytes"],
            limit,
            "tmpfs",
            True,
        )
        assert held + need > limit >= held, r
        assert r["resumed"] == (2, True)  # the newest committed step, bit for bit
    for node in (0, 1):
        root = os.path.join(shm_base, f"node{node}")
        assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002"], os.listdir(root)
        assert os.readlink(os.path.join(root, "latest")) == "step_0000000002"


def _first_save_too_big(base: str) -> tuple:
    import ckptlib

    limit = ROWS * COLS * 4 // 4  # the whole state's bytes over 4: less than a node's 2 shards + 2 replicas
    mgr = ckptlib.CheckpointManager(_root(base), cluster=Cluster(replicas=1, max_local_bytes=limit))
    try:
        mgr.save(1, _state(1))
    except LocalLimitError as exc:
        return exc.need, exc.limit, exc.held, sorted(os.listdir(_root(base))) if os.path.isdir(_root(base)) else []
    finally:
        mgr.close()
    return None


@needs_shm
def test_the_first_save_is_judged_from_the_state_bytes(shm_base, dist_run):
    results = dist_run(4, _first_save_too_big, shm_base, nodes=2)
    shard = ROWS * COLS * 4 // 4
    for need, limit, held, listing in results:
        # the node's 2 ranks' shards, and the 2 replicas it keeps for its partner
        assert (need, limit, held) == (2 * shard * 2, shard, 0), (need, limit, held)
        assert not any(name.startswith("step_") for name in listing), listing


def _resume_from_memory(root: str) -> tuple:
    import ckptlib

    mgr = ckptlib.CheckpointManager(root, cluster=Cluster(replicas=1))
    state = _state(0, zero=True)
    step = mgr.load(state)
    sources = mgr.last_load.bytes_by_source
    mgr.close()
    return step, torch.equal(state["w"].full_tensor(), _state(step)["w"].full_tensor()), sources


def _save_in_memory(base: str) -> int:
    import ckptlib

    mgr = ckptlib.CheckpointManager(
        _root(base), keep_last=1, async_save=ckptlib.AsyncMode("process"), cluster=Cluster(replicas=1)
    )
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    mgr.wait()
    mgr.close()
    return mgr.local_usage().newest_step_bytes


@needs_shm
def test_a_host_lost_resumes_from_the_peers_memory_at_another_world_size(shm_base, dist_run):
    assert len(set(dist_run(4, _save_in_memory, shm_base, nodes=2))) == 1
    shutil.rmtree(os.path.join(shm_base, "node0"))  # the host and its memory are gone
    survivor = os.path.join(shm_base, "node1")  # its own files and node 0's replicas
    for step, equal, sources in dist_run(2, _resume_from_memory, survivor):
        assert (step, equal) == (3, True) and sources.get("remote", 0) == 0, (step, equal, sources)


# -- nodes bounded differently: one row size on every rank (reliability round five) ----------------
def _mixed(shm_base: str, disk_base: str, case: str) -> dict:
    """Rank 0's node root on tmpfs (or, "limit-on-one-rank", on disk with a 40-byte limit),
    rank 1's on disk without a limit: each sends its own kind of figures into the save's round."""
    import torch.distributed as dist

    import ckptlib

    rank = dist.get_rank()
    limited = case == "limit-on-one-rank" and rank == 0
    base = shm_base if case == "tmpfs-beside-disk" and rank == 0 else disk_base
    root = os.path.join(base, f"node{rank}")
    mgr = ckptlib.CheckpointManager(root, cluster=Cluster(max_local_bytes=40 if limited else None))
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 1}  # 48 bytes a rank
    outcome: tuple = ("ok",)
    try:
        mgr.save(1, state)
    except ckptlib.CheckpointError as exc:
        outcome = (type(exc).__name__, str(exc), getattr(exc, "node", None), getattr(exc, "need", None))
    dist.barrier()
    listing = sorted(os.listdir(root)) if os.path.isdir(root) else []
    fresh = {"w": torch.zeros(3, 4), "step": -1}
    resumed = mgr.load(fresh)
    usage = mgr.local_usage()
    mgr.close()
    return {
        "outcome": outcome,
        "listing": listing,
        "resumed": (resumed, torch.equal(fresh["w"], state["w"]) if resumed else None),
        "memory": usage.in_memory,
    }


@needs_shm
@pytest.mark.parametrize("case", ["tmpfs-beside-disk", "limit-on-one-rank"])
def test_nodes_bounded_differently_agree_in_one_round(shm_base, tmp_path, dist_run, case):
    """Before: the bounded rank sent 4 figures and the other none into one all_gather: gloo
    aborted one rank (SIGABRT) and the other hung or blamed the wrong cause."""
    if filesystem_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("the temporary directory is itself in memory here")
    results = dist_run(2, _mixed, shm_base, str(tmp_path), case, nodes=2, timeout=150)
    if case == "tmpfs-beside-disk":  # bounded by its free space only: the save goes through
        for rank, r in enumerate(results):
            assert r["outcome"] == ("ok",) and r["resumed"] == (1, True), r
            assert r["listing"] == ["latest", "step_0000000001"] and r["memory"] == (rank == 0), r
        return
    root0 = os.path.join(str(tmp_path), "node0")
    want = (
        "LocalLimitError",
        f"node 0: a save would need about 48 more bytes in {root0!r}, which holds 0: past max_local_bytes=40; "
        "nothing was written (keep fewer steps, raise the limit, or give the root more space)",
        0,
        48,
    )
    for r in results:  # the same error on both ranks, naming node 0's root; nothing written
        assert r["outcome"] == want and r["listing"] == [] and r["resumed"] == (None, None), r
