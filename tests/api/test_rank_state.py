"""Per-rank state (RNG, dataloader position): exact on the same world size, a policy on resize."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib._torch import probes
from ckptlib.state.state import derived_seed


class Loader:
    """A stand-in for a per-rank dataloader: its position differs on every rank."""

    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


def _draws() -> tuple:
    return (random.random(), float(np.random.rand()), torch.rand(2).tolist())


def _save(uri: str):
    rank = dist.get_rank()
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    ckptlib.save(uri, {"rng": ckptlib.RNGState(), "loader": ckptlib.RankLocal(Loader(10 * rank + 7))}, step=5)
    return _draws()  # what each rank draws next after the save


def _load(uri: str):
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    loader = Loader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ckptlib.load(uri, {"rng": ckptlib.RNGState(), "loader": ckptlib.RankLocal(loader)})
    messages = [str(w.message) for w in caught if issubclass(w.category, ckptlib.ResizeWarning)]
    return _draws(), loader.position, messages, result.notes


def test_same_world_size_restores_every_rank_exactly(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    after_save = dist_run(3, _save, uri)
    loaded = dist_run(3, _load, uri)
    for rank in range(3):
        draws, position, warned, notes = loaded[rank]
        assert draws == after_save[rank]
        assert position == 10 * rank + 7
        assert warned == [] and notes == []


def test_grow_keeps_existing_ranks_and_seeds_new_ones(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    after_save = dist_run(2, _save, uri)
    loaded = dist_run(4, _load, uri)
    for rank in (0, 1):
        assert loaded[rank][0] == after_save[rank]
        assert loaded[rank][1] == 10 * rank + 7
    for rank in (2, 3):
        seed = derived_seed(5, rank)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        assert loaded[rank][0] == _draws()  # deterministic derived seed
        assert loaded[rank][1] == 0  # a new rank's loader starts fresh
    assert loaded[2][0] != loaded[3][0]
    for rank in range(4):
        assert loaded[rank][2], f"rank {rank} got no ResizeWarning"
        assert "saved by 2 ranks, loading on 4" in loaded[rank][2][0]
    assert "rank 3 starts fresh per-rank state (KeepExistingRanks)" in loaded[3][2][0]


def test_shrink_drops_vanished_ranks(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    after_save = dist_run(4, _save, uri)
    loaded = dist_run(2, _load, uri)
    assert [r[0] for r in loaded] == after_save[:2]
    assert [r[1] for r in loaded] == [7, 17]
    assert all("saved by 4 ranks, loading on 2" in r[2][0] for r in loaded)


class FromRankZero:
    """A custom policy: every rank restores rank 0's state."""

    def source_rank(self, rank, saved_world_size, world_size):
        return 0


def _load_with_policy(uri: str):
    loader = Loader()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptlib.ResizeWarning)
        ckptlib.load(uri, {"loader": ckptlib.RankLocal(loader, policy=FromRankZero())}, strict=False)
    return loader.position


def test_custom_resize_policy(tmp_path, dist_run):
    uri = str(tmp_path / "c")
    dist_run(2, _save, uri)
    assert dist_run(3, _load_with_policy, uri) == [7, 7, 7]


def test_rank_local_needs_stateful():
    with pytest.raises(
        ckptlib.StateError, match="RankLocal needs an object with state_dict\\(\\)/load_state_dict\\(\\), got int"
    ):
        ckptlib.RankLocal(3)


def test_derived_seeds_are_stable():
    """A fresh rank's seed is a fixed function of (step, rank): the same in every release, so
    a resumed run is reproducible; an unknown step (None) has its own seeds, not step 1's."""
    assert derived_seed(None, 0) == 3679785045524520890
    assert derived_seed(5, 3) == 407708805009305925
    assert derived_seed(1, 0) == 9159886843107480480
    assert derived_seed(0, 1) == 648344707019214003  # the digest's top bit is masked off: 63 bits
    assert all(0 <= derived_seed(step, rank) < 1 << 63 for step in range(10) for rank in range(8))


class _MergeMarks:
    """A merging policy whose merged state is recognisable."""

    def source_rank(self, rank, saved_world_size, world_size):
        return 0

    def merge(self, states, rank, world_size):
        return {"position": -1000 - len(states)}


def test_merging_policy_is_not_used_at_the_same_world_size(tmp_path):
    ckptlib.save(tmp_path / "c", {"loader": ckptlib.RankLocal(Loader(7))})
    loader = Loader()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckptlib.ResizeWarning)
        result = ckptlib.load(tmp_path / "c", {"loader": ckptlib.RankLocal(loader, policy=_MergeMarks())})
    assert loader.position == 7 and result.notes == []


class _SaveOnly:
    def state_dict(self):
        return {"position": 1}


def test_rank_local_needs_both_state_methods():
    with pytest.raises(ckptlib.StateError) as caught:
        ckptlib.RankLocal(_SaveOnly())
    assert str(caught.value) == "RankLocal needs an object with state_dict()/load_state_dict(), got _SaveOnly"


def test_resize_warning_points_at_the_caller(tmp_path, dist_run):
    """The ResizeWarning names the line that called ckptlib.load, not a line inside ckptlib."""
    uri = str(tmp_path / "c")
    dist_run(2, _save, uri)
    loader = Loader()
    with pytest.warns(ckptlib.ResizeWarning) as caught:
        ckptlib.load(uri, {"rng": ckptlib.RNGState(), "loader": ckptlib.RankLocal(loader)})
    assert [w.filename for w in caught if issubclass(w.category, ckptlib.ResizeWarning)] == [__file__, __file__]
    assert loader.position == 7


def test_default_policy_is_an_immutable_value():
    import dataclasses

    policy = ckptlib.KeepExistingRanks()
    assert policy == ckptlib.KeepExistingRanks() and hash(policy) == hash(ckptlib.KeepExistingRanks())
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.extra = 1


def test_rng_state_saved_without_cuda_loads_where_cuda_is_available(tmp_path, monkeypatch):
    """A CPU run's RNG state resumed on a machine with CUDA: the CUDA generator is left alone."""
    torch.manual_seed(11)
    ckptlib.save(tmp_path / "c", {"rng": ckptlib.RNGState()})
    expected = torch.rand(3)
    set_calls = []
    monkeypatch.setattr(probes, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *args, **kwargs: set_calls.append(args))
    torch.manual_seed(0)
    ckptlib.load(tmp_path / "c", {"rng": ckptlib.RNGState()})
    assert set_calls == [] and torch.equal(torch.rand(3), expected)


def test_rng_state_does_not_start_cuda_to_save_it(monkeypatch):
    """Where CUDA is available but this process never used it, saving the RNG state neither
    initialises CUDA nor records a CUDA generator state."""
    calls = []
    monkeypatch.setattr(probes, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *args, **kwargs: calls.append(args) or torch.zeros(1))
    sd = ckptlib.RNGState().state_dict()
    assert calls == [] and "cuda" not in sd


def test_rng_state_of_a_process_using_cuda_includes_its_generator(monkeypatch):
    """Where this process has used CUDA, its device generator's state is saved with the rest."""
    cuda_state = torch.arange(4, dtype=torch.uint8)
    monkeypatch.setattr(probes, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *args, **kwargs: cuda_state)
    assert ckptlib.RNGState().state_dict()["cuda"] is cuda_state


@pytest.mark.parametrize(
    "saved,world,sources",
    [
        (2, 4, [0, 1, None, None]),  # grow: the new ranks start fresh
        (4, 2, [0, 1]),  # shrink: ranks 2 and 3 are dropped
        (3, 3, [0, 1, 2]),
        (1, 2, [0, None]),
    ],
    ids=["grow2to4", "shrink4to2", "same3", "grow1to2"],
)
def test_keep_existing_ranks_sources(saved, world, sources):
    policy = ckptlib.KeepExistingRanks()
    assert [policy.source_rank(rank, saved, world) for rank in range(world)] == sources


def test_an_object_with_only_state_dict_is_saved_as_an_object(tmp_path):
    ckptlib.save(tmp_path / "c", {"x": _SaveOnly()})
    state = {"x": None}
    ckptlib.load(tmp_path / "c", state, trusted=True)
    assert isinstance(state["x"], _SaveOnly)


class _Slotted:
    """Pickles with protocol 2 (what a save writes), not with protocols 0 and 1."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def test_a_value_that_pickles_as_saves_pickle_passes_the_check(tmp_path):
    ckptlib.save(tmp_path / "c", {"obj": _Slotted(5)})
    state = {"obj": None}
    ckptlib.load(tmp_path / "c", state, trusted=True)
    assert isinstance(state["obj"], _Slotted) and state["obj"].value == 5


class _StartFresh:
    def source_rank(self, rank, saved_world_size, world_size):
        return None


def _save_loader_and_weights(uri: str):
    ckptlib.save(uri, {"loader": ckptlib.RankLocal(Loader(10 * dist.get_rank() + 7)), "w": torch.arange(4.0)})


@pytest.mark.parametrize("policy", [_MergeMarks(), _StartFresh()], ids=["merge", "start-fresh"])
def test_entries_after_a_resized_rank_local_are_loaded(tmp_path, dist_run, policy):
    uri = str(tmp_path / "c")
    dist_run(2, _save_loader_and_weights, uri)
    loader = Loader(-1)
    state = {"loader": ckptlib.RankLocal(loader, policy=policy), "w": torch.zeros(4)}
    with pytest.warns(ckptlib.ResizeWarning):
        ckptlib.load(uri, state)
    assert state["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loader.position == (-1002 if isinstance(policy, _MergeMarks) else -1)
