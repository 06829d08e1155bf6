"""Data-loader position across a data-parallel resize: torchdata's StatefulDataLoader over
ckptlib's ElasticDistributedSampler, saved mid-epoch at N ranks (unequal progress per
rank), resumed at M with MergeSamplerProgress: over the epoch every sample is seen once."""

from __future__ import annotations

import pytest

import ckptlib
from ckptlib.state.sampler import ElasticDistributedSampler, MergeSamplerProgress, merge_progress

pytestmark = pytest.mark.elastic

LENGTH, BATCH, SEED = 53, 3, 11


def _loader(num_workers: int = 0, world: int | None = None, rank: int | None = None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sampler = ElasticDistributedSampler(LENGTH, world, rank, shuffle=True, seed=SEED)
    sampler.set_epoch(1)
    return StatefulDataLoader(list(range(LENGTH)), batch_size=BATCH, sampler=sampler, num_workers=num_workers)


def _take(loader, batches: int | None) -> list[int]:
    seen = []
    for i, batch in enumerate(loader):
        seen += batch.tolist()
        if batches is not None and i + 1 == batches:
            break
    return seen


def save_part(uri: str, num_workers: int, first: int) -> list[int]:
    """Consume `first` + rank batches (unequal progress), save; the indices consumed."""
    import torch.distributed as dist

    loader = _loader(num_workers)
    seen = _take(loader, first + dist.get_rank())
    ckptlib.save(uri, {"data": ckptlib.RankLocal(loader, policy=MergeSamplerProgress())})
    return seen


def resume_part(uri: str, num_workers: int, stop_after: int | None = None, save_to: str | None = None) -> list[int]:
    """Load, consume (the rest of the epoch, or `stop_after` batches and save again)."""
    loader = _loader(num_workers)
    state = {"data": ckptlib.RankLocal(loader, policy=MergeSamplerProgress())}
    ckptlib.load(uri, state)
    seen = _take(loader, stop_after)
    if save_to:
        ckptlib.save(save_to, state)
    return seen


def _flat(per_rank: list[list[int]]) -> list[int]:
    return [i for seen in per_rank for i in seen]


@pytest.mark.parametrize(
    ("n", "m", "workers"),
    [(4, 2, 0), (2, 3, 0), (3, 3, 0), (3, 2, 2)],
    ids=["save4-load2", "save2-load3", "save3-load3", "save3-load2-workers2"],
)
def test_every_sample_once_across_a_resize(n, m, workers, tmp_path, dist_run):
    pytest.importorskip("torchdata.stateful_dataloader")
    uri = str(tmp_path / "ckpt")
    before = _flat(dist_run(n, save_part, uri, workers, 2))
    after = _flat(dist_run(m, resume_part, uri, workers))
    assert sorted(before + after) == list(range(LENGTH))
    assert len(before) == sum(min(BATCH * (2 + r), len(range(r, LENGTH, n))) for r in range(n))


def test_two_resizes_in_one_epoch(tmp_path, dist_run):
    pytest.importorskip("torchdata.stateful_dataloader")
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    seen = _flat(dist_run(4, save_part, first, 0, 1))
    seen += _flat(dist_run(2, resume_part, first, 0, 2, second))  # consumed set is no longer a prefix
    seen += _flat(dist_run(3, resume_part, second, 0))
    assert sorted(seen) == list(range(LENGTH))


def _walk(world: int, rank: int, state=None) -> list[int]:
    sampler = ElasticDistributedSampler(LENGTH, world, rank, seed=SEED)
    if state:
        sampler.resume(state)
    return list(sampler)


def test_merge_handles_unequal_progress_without_a_process_group():
    iters = [iter(ElasticDistributedSampler(LENGTH, 3, r, seed=SEED)) for r in range(3)]
    taken = [[next(it) for _ in range(k)] for it, k in zip(iters, (5, 0, 9))]
    states = [it.state_dict() for it in iters]
    rest = [_walk(2, r, merge_progress(states, r, 2)) for r in range(2)]
    assert sorted(_flat(taken) + _flat(rest)) == list(range(LENGTH))
    assert abs(len(rest[0]) - len(rest[1])) <= 1


def test_fresh_epoch_matches_distributed_sampler_order_without_padding():
    from torch.utils.data import DistributedSampler

    ours = [_walk(4, r) for r in range(4)]
    theirs = [list(DistributedSampler(range(LENGTH), 4, r, seed=SEED)) for r in range(4)]
    for r in range(4):
        assert ours[r] == theirs[r][: len(ours[r])]
    assert sorted(_flat(ours)) == list(range(LENGTH))


def test_resuming_one_rank_at_another_world_size_is_refused():
    it = iter(ElasticDistributedSampler(LENGTH, 4, 1, seed=SEED))
    next(it)
    other = iter(ElasticDistributedSampler(LENGTH, 2, 1, seed=SEED))
    with pytest.raises(ckptlib.StateError, match="rank 1 of 4 cannot resume rank 1 of 2"):
        other.load_state_dict(it.state_dict())


def test_merge_refuses_states_that_disagree():
    states = [iter(ElasticDistributedSampler(LENGTH, 2, r, seed=SEED + r)).state_dict() for r in range(2)]
    with pytest.raises(ckptlib.StateError, match="disagree on the sampler's seed"):
        merge_progress(states, 0, 3)
    with pytest.raises(ckptlib.StateError, match="one state from each of 2 saved ranks"):
        merge_progress(states[:1], 0, 3)
