"""Multi-node, simulated: 2 nodes x 2 ranks on this machine.

The launcher's `nodes=2` gives each rank the environment torchrun gives it on a real
cluster (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, ...), so code that keys anything by
node or local rank runs as it would on two hosts. The cases:

- a save/load round trip on 2x2 ranks, loaded again on 2x2 and on one node of 3 ranks;
- the `latest` pointer is written exactly once per save, by global rank 0, and there is
  no per-node or per-rank pointer (per-rank pointers went stale after a resize in
  mosaicml/composer#2409);
- node-local scratch space does not collide: both "nodes" have local ranks 0 and 1, so
  anything keyed by LOCAL_RANK would be written twice; shard files and per-rank state must
  be keyed by global rank, and a save leaves nothing behind in node-local scratch
  directories;
- a real two-launch torchrun run (`--nnodes 2 --node-rank i --rdzv-endpoint 127.0.0.1:PORT`)
  of examples/train.py, resumed on one node (slow: 2 agents + 4 workers import torch).
"""

from __future__ import annotations

import json
import os

import pytest
from helpers.torchrun import REPO, Nodes

from ckptlib._torch import parallel
from ckptlib.testing.matrices import matrix as mx

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


def default_wrap() -> str:
    return "fsdp2" if parallel.fsdp2_cpu_reason() is None else "ddp"


def topology() -> dict:
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        **{k: int(os.environ[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")},
    }


def test_simulated_topology(dist_run):
    """The launcher's 2x2 layout is torchrun's: rank = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK."""
    topo = dist_run(WORLD, topology, nodes=NODES)
    assert [(t["GROUP_RANK"], t["LOCAL_RANK"]) for t in topo] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for t in topo:
        assert t["rank"] == t["GROUP_RANK"] * t["LOCAL_WORLD_SIZE"] + t["LOCAL_RANK"]
        assert (t["world"], t["LOCAL_WORLD_SIZE"], t["GROUP_WORLD_SIZE"]) == (WORLD, PER_NODE, NODES)


@pytest.mark.parametrize("load_nodes,load_ws", [(2, 4), (1, 3)], ids=["load-2x2", "load-1x3"])
def test_round_trip_on_two_nodes(tmp_path, dist_run, load_nodes, load_ws):
    """Train and save on 2 nodes x 2 ranks through CheckpointManager; load on 2x2 and on 1x3:
    bit-identical state, and one more step matches a never-checkpointed run."""
    wrap = default_wrap()
    root = str(tmp_path / "run")
    expected = dist_run(WORLD, mx.save_side, root, wrap, "adamw", manager=True, nodes=NODES)[0]
    problems = dist_run(load_ws, mx.load_side, root, wrap, "adamw", expected, manager=True, nodes=load_nodes)
    assert problems == [[]] * load_ws


def save_counting_pointer_writes(root: str, steps: int) -> dict:
    """Rank body: save `steps` checkpoints; return this rank's pointer writes and topology."""

    import ckptlib
    from ckptlib.storage.local import LocalStorage

    writes: list[tuple[str, str]] = []
    original = LocalStorage.set_pointer

    def counting(self, name, target):
        writes.append((name, target))
        return original(self, name, target)

    LocalStorage.set_pointer = counting
    try:
        model, optim = mx.setup(default_wrap(), "adamw", seed=0)
        mgr = ckptlib.CheckpointManager(root)
        for step in range(1, steps + 1):
            mx.train_step(model, optim, step)
            mgr.save(step, {"model": model, "optim": optim, "step": step})
        latest_seen = mgr.latest()  # every rank reads the one pointer
    finally:
        LocalStorage.set_pointer = original
    return {**topology(), "writes": writes, "latest": latest_seen}


def test_latest_pointer_written_once_per_save(tmp_path, dist_run):
    root = tmp_path / "run"
    results = dist_run(WORLD, save_counting_pointer_writes, str(root), 3, nodes=NODES)
    by_rank = {r["rank"]: r["writes"] for r in results}
    assert by_rank[0] == [("latest", f"step_{s:010d}") for s in (1, 2, 3)]
    assert all(writes == [] for rank, writes in by_rank.items() if rank != 0), by_rank
    assert [r["latest"] for r in results] == [3] * WORLD
    pointers = [name for name in os.listdir(root) if "latest" in name]
    assert pointers == ["latest"], f"one pointer for the whole job, found {pointers}"


class RankTag:
    """Per-rank state whose value is the global rank that saved it."""

    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> dict:
        import torch

        return {"value": torch.tensor([self.value])}

    def load_state_dict(self, sd: dict) -> None:
        self.value = int(sd["value"][0])


def save_with_node_scratch(root: str, scratch_base: str) -> dict:
    """Rank body: point this rank's temp dir at its node's scratch dir (a node-local disk),
    save per-rank state and a sharded model, then load it back into fresh objects."""
    import tempfile

    import ckptlib

    topo = topology()
    scratch = os.path.join(scratch_base, f"node{topo['GROUP_RANK']}")
    os.makedirs(scratch, exist_ok=True)
    os.environ["TMPDIR"] = scratch
    tempfile.tempdir = None  # re-read TMPDIR

    model, optim = mx.setup(default_wrap(), "sgd", seed=0)
    mx.train_step(model, optim, 0)
    tag = ckptlib.RankLocal(RankTag(1000 + topo["rank"]))
    ckptlib.CheckpointManager(root).save(1, {"model": model, "optim": optim, "tag": tag})
    saved = mx.full_state(model, optim)

    model2, optim2 = mx.setup(default_wrap(), "sgd", seed=5)
    tag2 = ckptlib.RankLocal(RankTag(-1))
    ckptlib.CheckpointManager(root).load({"model": model2, "optim": optim2, "tag": tag2})
    return {
        **topo,
        "tag": tag2.obj.value,
        "problems": mx.differences(saved, mx.full_state(model2, optim2)),
        "scratch_left": sorted(os.listdir(scratch)),
    }


def test_node_local_state_and_scratch_do_not_collide(tmp_path, dist_run):
    root, scratch = tmp_path / "run", tmp_path / "scratch"
    results = dist_run(WORLD, save_with_node_scratch, str(root), str(scratch), nodes=NODES)
    # per-rank state comes back to the global rank that saved it (LOCAL_RANK repeats per node)
    assert [r["tag"] for r in results] == [1000 + r["rank"] for r in results]
    assert all(r["problems"] == [] for r in results), [r["problems"] for r in results]
    # one shard file per *global* rank, each listed in the manifest with its real size
    step = root / "step_0000000001"
    shards = sorted(n for n in os.listdir(step) if n.endswith(".distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(WORLD)]
    manifest = json.loads((step / "ckptlib.json").read_text())
    assert manifest["world_size"] == WORLD
    for name in shards:
        assert manifest["files"][name]["size"] == os.path.getsize(step / name)
    # nothing staged in node-local scratch space is left behind, on either node
    assert [r["scratch_left"] for r in results] == [[]] * WORLD
    assert sorted(os.listdir(scratch)) == ["node0", "node1"]


# --------------------------------------------------------------------------- real torchrun

TRAIN = str(REPO / "examples" / "train.py")


def run_example(argv: list[str]) -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckptlib_example_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def losses(path) -> dict[int, float]:
    with open(path, encoding="utf-8") as f:
        return {rec["step"]: rec["loss"] for rec in map(json.loads, f)}


@pytest.mark.slow
def test_torchrun_two_nodes_then_resume_on_one(tmp_path, dist_run):
    """Two torchrun launches (node ranks 0 and 1, static rendezvous on 127.0.0.1) train
    examples/train.py on 2x2 ranks to step 6; one node of 2 ranks resumes to step 9. The
    losses equal an uninterrupted single-rank run's bit for bit (the example is built to be
    world-size independent; see tests/cli/test_example.py)."""
    root, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    common = ["--root", str(root), "--save-every", "3"]
    first = [TRAIN, *common, "--steps", "6", "--loss-log", str(log)]
    with Nodes.start(first, [PER_NODE] * NODES, tmp_path / "logs") as nodes:
        finished = nodes.wait(240)
    assert finished and nodes.returncodes() == [0] * NODES, nodes.tails(5000)
    outputs = [nodes.output(node) for node in range(NODES)]
    assert "fresh start; 4 ranks" in outputs[0]
    manifest = json.loads((root / "step_0000000006" / "ckptlib.json").read_text())
    assert manifest["world_size"] == WORLD

    assert dist_run(2, run_example, [*common, "--steps", "9", "--log", str(log)]) == [0, 0]
    ref_log = tmp_path / "ref.jsonl"
    dist_run(
        1, run_example, ["--root", str(tmp_path / "ref"), "--save-every", "3", "--steps", "9", "--log", str(ref_log)]
    )
    assert losses(log) == losses(ref_log)
    assert sorted(losses(log)) == list(range(1, 10))
