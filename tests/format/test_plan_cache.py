"""Plan once (issue 25.2): a save reuses the previous save's plans while the state's structure
is unchanged, and re-plans after every kind of change.

Each scenario saves a sequence of states on 2 ranks with one PlanCache per rank; every save is
also made without a cache, and each must give the same `.metadata` byte for byte (with one
fixed checkpoint path), load back bit-exact, and plan exactly when it should: a reused save calls neither the
local nor the global planner (counted, not timed), a re-planned one calls both.
"""

from __future__ import annotations

import errno
import functools
import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib.format.write import plan_cache, save_planner
from ckptlib.format.write.dcp_writer import CkptWriter
from ckptlib.saving.async_mode import AsyncMode
from ckptlib.saving.saving import transact
from ckptlib.storage import as_storage

WORLD = 2


def metadata_bytes(path: str) -> bytes:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return f.read()


# --------------------------------------------------------------------------- states


def _mesh(shape=(WORLD,)):
    from ckptlib._torch import parallel

    return parallel.init_device_mesh_fn()("cpu", shape)


def _dt(tensor, placements, mesh=None):
    from ckptlib._torch import parallel

    return parallel.distribute_locally(tensor, mesh or _mesh(), placements)


def _base(k: int, **changes) -> dict:
    """The state of save `k`: values change every save (objects grow), the structure does not."""
    from torch.distributed.tensor import Shard

    g = torch.Generator().manual_seed(k)
    model = {
        "a": _dt(torch.randn(4 * WORLD, 6, generator=g), [Shard(0)]),
        "b": _dt(torch.randn(3, 2 * WORLD, generator=g), [Shard(1)]),
        "r": torch.randn(5, generator=g),
    }
    model.update(changes.pop("model", {}))
    for key in changes.pop("drop", ()):
        model.pop(key)
    state = {"model": model, "step": k, "name": "x" * (k + 1), "sched": {"last_lr": [0.1 * k] * (k + 1)}}
    state.update(changes)
    return state


def _rows(k, placements, dtype=torch.float32, mesh=None):
    g = torch.Generator().manual_seed(100 + k)
    return _dt(torch.randn(4 * WORLD, 6, generator=g).to(dtype), placements, mesh)


def _shard0(k):
    from torch.distributed.tensor import Shard

    return _rows(k, [Shard(0)])


def _states(scenario: str, rank: int) -> list:
    """[(state factory, expected plan_reused or "fails:<file>")] of one scenario."""
    from torch.distributed.tensor import Replicate, Shard

    base = _base
    if scenario == "unchanged":
        return [(base, False), (base, True), (base, True)]
    if scenario == "key-added":
        added = lambda k: base(k, model={"new": torch.ones(2)})  # noqa: E731
        return [(base, False), (added, False), (added, True)]
    if scenario == "key-removed":
        return [(base, False), (lambda k: base(k, drop=["r"]), False)]
    if scenario == "shape":
        return [(base, False), (lambda k: base(k, model={"r": torch.zeros(6)}), False)]
    if scenario == "dtype":
        return [(base, False), (lambda k: base(k, model={"a": _rows(k, [Shard(0)], torch.bfloat16)}), False)]
    if scenario == "requires-grad":
        return [(base, False), (lambda k: base(k, model={"r": torch.zeros(5, requires_grad=True)}), False)]
    if scenario == "shard0-to-shard1":
        return [
            (lambda k: base(k, model={"a": _shard0(k)}), False),
            (lambda k: base(k, model={"a": _rows(k, [Shard(1)])}), False),
        ]
    if scenario == "shard-to-replicate":
        return [
            (lambda k: base(k, model={"a": _shard0(k)}), False),
            (lambda k: base(k, model={"a": _rows(k, [Replicate()])}), False),
        ]
    if scenario == "same-world-other-mesh":  # identical chunks, another mesh: still re-planned
        other = lambda k: base(k, model={"a": _rows(k, [Replicate(), Shard(0)], mesh=_mesh((1, WORLD)))})  # noqa: E731
        return [(base, False), (other, False), (other, True)]
    if scenario == "mesh-reordered":  # the same placements over the same ranks, in another order
        from torch.distributed.device_mesh import DeviceMesh

        def reordered(k):
            return base(k, model={"a": _rows(k, [Shard(0)], mesh=DeviceMesh("cpu", list(range(WORLD))[::-1]))})

        return [(lambda k: base(k, model={"a": _shard0(k)}), False), (reordered, False), (reordered, True)]
    if scenario == "object-to-tensor":
        return [(base, False), (lambda k: base(k, step=torch.tensor(k)), False), (base, False)]
    if scenario == "list-to-dict":  # the same flat keys ("l.0", "l.1"), other mappings
        listed = lambda k: base(k, l=[torch.ones(2), torch.zeros(3)])  # noqa: E731
        keyed = lambda k: base(k, l={"0": torch.ones(2), "1": torch.zeros(3)})  # noqa: E731
        return [(listed, False), (keyed, False), (keyed, True)]
    if scenario == "one-rank-changes":
        mine = lambda k: base(k, **{f"local{rank}": torch.zeros(3 if rank == 1 and k > 0 else 2)})  # noqa: E731
        return [(mine, False), (mine, False), (mine, True)]
    if scenario == "enospc-metadata":  # a failed save between two saves must not poison the cache
        other = lambda k: base(k, model={"new": torch.ones(2)})  # noqa: E731
        return [(base, False), (other, "fails:.metadata"), (base, True), (other, False), (other, True)]
    if scenario == "enospc-shard":
        return [(base, False), (base, "fails:__1_0.distcp"), (base, True)]
    raise AssertionError(scenario)


# --------------------------------------------------------------------------- ranks


def _fixed_ids(fn):
    """The rank function `fn`, with every save naming the same checkpoint path in `.metadata`
    (files saved to different directories then compare byte for byte)."""

    @functools.wraps(fn)
    def run(*args):
        original = CkptWriter.storage_meta

        def fixed(self):
            meta = original(self)
            meta.checkpoint_id = "<checkpoint>"
            return meta

        CkptWriter.storage_meta = fixed
        try:
            return fn(*args)
        finally:
            CkptWriter.storage_meta = original

    return run


class _Counter:
    """Counts calls of the local and global planners (the module functions CkptSavePlanner calls)."""

    def __init__(self) -> None:
        self.local = self.global_ = 0
        self._saved = (save_planner.local_save_plan, save_planner.global_save_plan)
        local, global_ = self._saved

        def counted_local(*args, **kwargs):
            self.local += 1
            return local(*args, **kwargs)

        def counted_global(*args, **kwargs):
            self.global_ += 1
            return global_(*args, **kwargs)

        save_planner.local_save_plan, save_planner.global_save_plan = counted_local, counted_global

    def close(self) -> tuple[int, int]:
        save_planner.local_save_plan, save_planner.global_save_plan = self._saved
        return self.local, self.global_


def _failing(path: str, name: str):
    """The Storage at `path`, whose write of file `name` fails with ENOSPC on this rank."""
    storage = as_storage(path)
    write, open_writer = storage.write, storage.open_writer

    def no_space(file):
        if file == name:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, file))

    def failing_write(file, data, **kwargs):
        no_space(file)
        return write(file, data, **kwargs)

    def failing_open_writer(file):
        no_space(file)
        return open_writer(file)

    storage.write, storage.open_writer = failing_write, failing_open_writer
    return storage


def _save(path, state, cache, *, storage=None, asynchronous=False, background_staging=False, async_mode="thread"):
    result = transact(
        storage or as_storage(path),
        state,
        step=None,
        metadata=None,
        metrics=None,
        overwrite=False,
        group=None,
        mode=AsyncMode(async_mode, background_staging) if asynchronous else None,
        plan_cache=cache,
    )
    return result.wait() if asynchronous else result


def _blank(value):
    """`value`'s structure with other values (tensors zeroed, objects replaced)."""
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value).detach().requires_grad_(value.requires_grad)
    return "unset"


def _same(a, b) -> bool:
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return isinstance(a, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, torch.Tensor):
        from torch.distributed.tensor import DTensor

        if isinstance(b, DTensor):
            return isinstance(a, DTensor) and a.placements == b.placements and _same(a.to_local(), b.to_local())
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach(), b.detach())
    return type(a) is type(b) and a == b


def _step(root: str, k: int, make, expected, cache, rank: int, **how) -> dict:
    """Save state `k` with `cache` (and without one, for reference); what every check found."""
    state = make(k)
    path, reference = f"{root}/cached{k}", f"{root}/reference{k}"
    out = {"expected": expected}
    counter = _Counter()
    try:
        storage = None
        if isinstance(expected, str):
            name = expected.split(":", 1)[1]
            fails_here = rank == (0 if name == ".metadata" else int(name[2]))
            storage = _failing(path, name) if fails_here else None
        try:
            result = _save(path, state, cache, storage=storage, **how)
        except ckptlib.CheckpointError as exc:
            out["failed"] = type(exc).__name__
            return out
    finally:
        out["local_plans"], out["global_plans"] = counter.close()
    out["reused"] = result.plan_reused
    out["planning_seconds"] = result.planning_seconds
    out["global_plan_seconds"] = result.global_plan_seconds
    _save(reference, state, plan_cache.PlanCache())
    dist.barrier()
    if rank == 0:
        out["same_metadata"] = metadata_bytes(path) == metadata_bytes(reference)
    loaded = _blank(state)
    ckptlib.load(path, loaded)
    out["bit_exact"] = _same(loaded, state)
    return out


@_fixed_ids
def rank_scenario(root: str, scenario: str) -> list[dict]:
    rank = dist.get_rank()
    cache = plan_cache.PlanCache()
    return [
        _step(f"{root}/{scenario}", k, make, expected, cache, rank)
        for k, (make, expected) in enumerate(_states(scenario, rank))
    ]


SCENARIOS = [
    "unchanged",
    "key-added",
    "key-removed",
    "shape",
    "dtype",
    "requires-grad",
    "shard0-to-shard1",
    "shard-to-replicate",
    "same-world-other-mesh",
    "mesh-reordered",
    "object-to-tensor",
    "list-to-dict",
    "one-rank-changes",
    "enospc-metadata",
    "enospc-shard",
]


def _check(steps_per_rank: list[list[dict]]) -> None:
    for rank, steps in enumerate(steps_per_rank):
        for k, step in enumerate(steps):
            where = f"rank {rank}, save {k}"
            expected = step["expected"]
            if isinstance(expected, str):
                assert step.get("failed"), (where, step)
                continue
            assert step["reused"] is expected, (where, step)
            assert step["bit_exact"], (where, step)
            if rank == 0:
                assert step["same_metadata"], (where, step)
            # reused: no planner ran; re-planned: the local planner on every rank, the global on rank 0
            assert step["local_plans"] == (0 if expected else 1), (where, step)
            assert step["global_plans"] == (0 if expected or rank else 1), (where, step)
            assert step["planning_seconds"] > 0 and step["global_plan_seconds"] >= 0, (where, step)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plans_are_reused_only_while_the_structure_is_unchanged(scenario, tmp_path, dist_run):
    _check(dist_run(WORLD, rank_scenario, str(tmp_path), scenario))


# --------------------------------------------------------------------------- more savers


@_fixed_ids
def rank_async_then_sync(root: str) -> list[dict]:
    """Async saves (thread, background staging, writer process) and sync ones: one cache for all."""
    rank, cache = dist.get_rank(), plan_cache.PlanCache()
    hows = [
        {"asynchronous": True},
        {},
        {"asynchronous": True, "background_staging": True},
        {"asynchronous": True, "async_mode": "process"},
        {},
    ]
    return [_step(root, k, _base, k > 0, cache, rank, **how) for k, how in enumerate(hows)]


def _trained(k: int) -> dict:
    """A model and Adam, stepped `k` times: no optimizer state before the first step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(k):
        model(torch.ones(2, 4)).sum().backward()
        optim.step()
    return {"model": model.state_dict(), "optim": _string_keys(optim.state_dict()), "step": k}


def _string_keys(value):
    if isinstance(value, dict):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_string_keys(v) for v in value]
    return value


@_fixed_ids
def rank_optimizer_state_appears(root: str) -> list[dict]:
    rank, cache = dist.get_rank(), plan_cache.PlanCache()
    return [_step(root, k, _trained, k == 2, cache, rank) for k in range(3)]


@_fixed_ids
def rank_tokens(root: str) -> list[dict]:
    """Ranks whose caches disagree (one emptied, one holding plans of a save the others never
    completed) make every rank re-plan, in the same round."""
    rank, cache = dist.get_rank(), plan_cache.PlanCache()
    out = [_step(root, 0, _base, False, cache, rank)]
    if rank == 0:
        cache.clear()
    out.append(_step(root, 1, _base, False, cache, rank))
    out.append(_step(root, 2, _base, True, cache, rank))
    if rank == 1:  # the same structure, but another save's plans
        entry = cache.entry
        cache.install(plan_cache.CachedPlan(entry.fingerprint, entry.token + 5, entry.final_plan, entry.skeleton))
    out.append(_step(root, 3, _base, False, cache, rank))
    out.append(_step(root, 4, _base, True, cache, rank))
    return out


def _plain(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(4, 3, generator=g), "step": k}


@_fixed_ids
def rank_groups(root: str) -> list[dict]:
    """One cache, two groups (the world and rank 0 alone): the world size changes, the state
    does not; and the module-level caches are per group."""
    rank, cache = dist.get_rank(), plan_cache.PlanCache()
    alone = dist.new_group([0])
    out = [_step(root, 0, _plain, False, cache, rank), _step(root, 1, _plain, True, cache, rank)]
    if rank == 0:
        for k, expected in [(2, False), (3, True)]:
            result = transact(
                as_storage(f"{root}/alone{k}"),
                _plain(k),
                step=None,
                metadata=None,
                metrics=None,
                overwrite=False,
                group=alone,
                plan_cache=cache,
            )
            out.append({"expected": expected, "reused": result.plan_reused})
    dist.barrier()
    out.append(_step(root, 4, _plain, False, cache, rank))  # back on the world: re-planned
    plan_cache.clear_shared()  # plain ckptlib.save: one module-level cache per group and storage kind
    shared = [ckptlib.save(f"{root}/shared{k}", _plain(k)).plan_reused for k in range(2)]
    if rank == 0:
        shared.append(ckptlib.save(f"{root}/shared-alone", _plain(2), process_group=alone).plan_reused)
    out.append({"shared": shared})
    return out


def test_async_then_sync_saves_share_one_cache(tmp_path, dist_run):
    _check(dist_run(WORLD, rank_async_then_sync, str(tmp_path)))


def test_optimizer_state_appearing_after_the_first_step_is_a_change(tmp_path, dist_run):
    _check(dist_run(WORLD, rank_optimizer_state_appears, str(tmp_path)))


def test_ranks_whose_caches_disagree_all_replan(tmp_path, dist_run):
    _check(dist_run(WORLD, rank_tokens, str(tmp_path)))


def test_a_new_group_or_world_size_replans(tmp_path, dist_run):
    rank0, rank1 = dist_run(WORLD, rank_groups, str(tmp_path))
    assert [s["reused"] for s in rank0[:5]] == [False, True, False, True, False]
    assert [s["reused"] for s in rank1[:3]] == [False, True, False]
    _check([[s for s in rank0[:5] if "local_plans" in s], rank1[:3]])
    assert rank0[5]["shared"] == [False, True, False] and rank1[3]["shared"] == [False, True]


@_fixed_ids
def rank_two_managers(root: str) -> list:
    from ckptlib import CheckpointManager

    managers = [CheckpointManager(f"{root}/one"), CheckpointManager(f"{root}/two")]
    reused = []
    for step in range(3):
        state = _base(step)
        reused.append([m.save(step, state).plan_reused for m in managers])
        for manager in managers:
            loaded = _blank(state)
            manager.load(loaded)
            assert _same(loaded, state), (manager.root_uri, step)
    _save(f"{root}/reference", _base(2), plan_cache.PlanCache())
    dist.barrier()
    files = [sorted(os.listdir(m.path(2))) for m in managers]
    same = [metadata_bytes(m.path(2)) == metadata_bytes(f"{root}/reference") for m in managers]
    return [reused, same, files]


def test_two_managers_on_two_roots_each_reuse_their_own_plans(tmp_path, dist_run):
    for reused, same, files in dist_run(WORLD, rank_two_managers, str(tmp_path)):
        assert reused == [[False, False], [True, True], [True, True]]
        assert same == [True, True]
        assert files[0] == files[1] and ".metadata" in files[0] and "__1_0.distcp" in files[0]


@_fixed_ids
def rank_mesh_4_to_2x2(root: str) -> list[dict]:
    """Four ranks: a flat mesh, then a 2x2 (HSDP-like: replicated over one dim, sharded over the other)."""
    from torch.distributed.tensor import Replicate, Shard

    rank, cache = dist.get_rank(), plan_cache.PlanCache()

    def flat(k):
        return {"w": _rows(k, [Shard(0)], mesh=_mesh((4,))), "step": k}

    def hsdp(k):
        return {"w": _rows(k, [Replicate(), Shard(0)], mesh=_mesh((2, 2))), "step": k}

    return [
        _step(root, k, make, expected, cache, rank)
        for k, (make, expected) in enumerate([(flat, False), (hsdp, False), (hsdp, True)])
    ]


def test_the_same_world_on_another_mesh_replans(tmp_path, dist_run):
    """On 2 nodes x 2 ranks (torchrun's environment per rank): the 2x2 mesh replicates across
    the nodes and shards within each, as HSDP does."""
    _check(dist_run(4, rank_mesh_4_to_2x2, str(tmp_path), nodes=2))
