"""Data-loader position across a data-parallel resize: every sample once per epoch.

`ElasticDistributedSampler` is a distributed sampler whose position survives a change of
world size. Like `DistributedSampler` it walks one epoch order (a seeded permutation, or
0..n-1) and gives rank r the positions r, r+W, r+2W, ...; unlike it, it never pads (a
sample appears once per epoch even when W does not divide n) and its iterator's state
records which positions of the epoch order are consumed, so progress can be merged.

`MergeSamplerProgress` is the resize policy for `RankLocal(loader, policy=...)` (a
torchdata `StatefulDataLoader`, or the sampler's own iterator state): on a load at another
world size every rank reads *every* saved rank's state, takes the union of the positions
the saved ranks consumed (ranks may have consumed different amounts), and deals the
remaining positions out over the new ranks. At the same world size each rank resumes
its own state (no merge).

What it assumes: the sampler is this one (or has the same state: epoch, seed, shuffle,
dataset length, the consumed positions, world, rank and how many it yielded), every rank
uses the same dataset length, seed and shuffle, and the state a rank saves counts what it
*consumed* (StatefulDataLoader's state does: prefetched batches are not counted). With
`DistributedSampler` no merge can be exact: its padding repeats samples, and its state
(if any) is one rank's count.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator, Sequence, Sized

import torch
from torch.utils.data import Sampler

from ckptlib.errors import StateError

MARKER = "ckptlib_elastic_sampler"
# Loader counters that describe the iterator a saved rank had, not the merged plan.
_LOADER_COUNTERS = ("_num_yielded", "_sampler_iter_yielded", "samples_yielded")


def _intervals(mask: torch.Tensor) -> list[list[int]]:
    """[[start, end), ...] of the True runs of a 1-D bool tensor."""
    padded = torch.cat([torch.tensor([False]), mask, torch.tensor([False])]).to(torch.int8)
    edges = torch.nonzero(padded[1:] - padded[:-1]).flatten().tolist()
    return [[edges[i], edges[i + 1]] for i in range(0, len(edges), 2)]


def _mask(intervals: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    mask = torch.zeros(length, dtype=torch.bool)
    for start, end in intervals:
        mask[start:end] = True
    return mask


class ElasticDistributedSampler(Sampler[int]):
    """Distributed sampler whose position can be resumed at another world size.

    Call `set_epoch(epoch)` before each epoch, as with `DistributedSampler`. Ranks get
    ceil or floor of the remaining samples / world size: the last step of an epoch may be
    short on some ranks (no padding, so no sample repeats).
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ):
        from ckptlib._runtime import agree as _dist

        self.length = dataset if isinstance(dataset, int) else len(dataset)
        self.num_replicas = _dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = _dist.get_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self._resume: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # a resumed position belongs to its own epoch only

    def resume(self, state: dict[str, Any]) -> None:
        """Start the next iteration from an iterator state (see `merge_progress`)."""
        _check_state(state)
        self.epoch = state["epoch"]
        self._resume = dict(state)

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.length)
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=gen)

    def __iter__(self) -> "_ElasticIterator":
        state, self._resume = self._resume, None
        return _ElasticIterator(self, state)

    def __len__(self) -> int:
        consumed = self._resume["consumed"] if self._resume else []
        remaining = self.length - int(_mask(consumed, self.length).sum())
        return len(range(self.rank, remaining, self.num_replicas))


class _ElasticIterator(Iterator[int]):
    """One epoch's walk; its state_dict is what StatefulDataLoader saves for the sampler."""

    def __init__(self, sampler: ElasticDistributedSampler, state: dict[str, Any] | None = None):
        self.sampler = sampler
        self._order = sampler.order()
        self._plan(state["consumed"] if state else [], state["yielded"] if state else 0)

    def _plan(self, consumed: list[list[int]], yielded: int) -> None:
        s = self.sampler
        self.consumed = [list(map(int, pair)) for pair in consumed]
        remaining = torch.nonzero(~_mask(self.consumed, s.length)).flatten()
        self.positions = remaining[s.rank :: s.num_replicas].tolist()
        self.yielded = yielded

    def __iter__(self) -> "_ElasticIterator":
        return self

    def __next__(self) -> int:
        if self.yielded >= len(self.positions):
            raise StopIteration
        position = self.positions[self.yielded]
        self.yielded += 1
        return int(self._order[position])

    def state_dict(self) -> dict[str, Any]:
        s = self.sampler
        return {
            MARKER: 1,
            "epoch": s.epoch,
            "seed": s.seed,
            "shuffle": s.shuffle,
            "length": s.length,
            "world": s.num_replicas,
            "rank": s.rank,
            "consumed": self.consumed,
            "yielded": self.yielded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(state)
        s = self.sampler
        if (state["world"], state["rank"]) != (s.num_replicas, s.rank):
            raise StateError(
                f"sampler state of rank {state['rank']} of {state['world']} cannot resume rank {s.rank} of "
                f"{s.num_replicas} by itself; use RankLocal(..., policy=ckptlib.MergeSamplerProgress())"
            )
        for key in ("seed", "shuffle", "length"):
            if state[key] != getattr(s, key):
                raise StateError(f"sampler state has {key}={state[key]!r}, this sampler {getattr(s, key)!r}")
        s.epoch = state["epoch"]
        self._order = s.order()
        self._plan(state["consumed"], state["yielded"])


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or state.get(MARKER) != 1:
        raise StateError(f"not an ElasticDistributedSampler state: {state!r:.200}")


def merge_progress(states: Sequence[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """The iterator state for `rank` of `world_size` that continues the epoch where the saved
    ranks (`states`, one per saved rank, in rank order) left off, together."""
    for state in states:
        _check_state(state)
    first = states[0]
    saved_world = first["world"]
    if sorted(s["rank"] for s in states) != list(range(saved_world)) or len(states) != saved_world:
        raise StateError(
            f"merging sampler progress needs one state from each of {saved_world} saved ranks, "
            f"got ranks {[s['rank'] for s in states]}"
        )
    for key in ("epoch", "seed", "shuffle", "length", "world", "consumed"):
        values = {repr(s[key]) for s in states}
        if len(values) > 1:
            raise StateError(f"saved ranks disagree on the sampler's {key}: {sorted(values)}")
    length = first["length"]
    consumed = _mask(first["consumed"], length)
    remaining = torch.nonzero(~consumed).flatten()
    for state in states:
        mine = remaining[state["rank"] :: saved_world]
        if state["yielded"] > len(mine):
            raise StateError(f"saved rank {state['rank']} yielded {state['yielded']} of its {len(mine)} samples")
        consumed[mine[: state["yielded"]]] = True
    return {**first, "world": world_size, "rank": rank, "consumed": _intervals(consumed), "yielded": 0}


def _find(obj: Any, path: tuple = ()) -> tuple | None:
    """The key path of the sampler state inside a (loader) state dict."""
    if isinstance(obj, dict):
        if obj.get(MARKER) == 1:
            return path
        for key, value in obj.items():
            found = _find(value, path + (key,))
            if found is not None:
                return found
    return None


def _reset_counters(obj: Any) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in _LOADER_COUNTERS and isinstance(value, int):
                obj[key] = 0
            elif key == "_iterator_finished":
                obj[key] = False
            else:
                _reset_counters(value)


@dataclasses.dataclass(frozen=True)
class MergeSamplerProgress:
    """Resize policy: merge every saved rank's ElasticDistributedSampler progress.

    Use as `RankLocal(loader, policy=MergeSamplerProgress())` where `loader` is a
    StatefulDataLoader over an ElasticDistributedSampler (or anything whose state dict
    holds that sampler's iterator state). Each rank gets the saved rank 0's state with
    the sampler's part replaced by the merged plan and the loader's counters zeroed.
    """

    def source_rank(self, rank: int, saved_world_size: int, world_size: int) -> int | None:
        return None  # never one rank's state: see merge

    def merge(self, states: Sequence[Any], rank: int, world_size: int) -> Any:
        paths = [_find(state) for state in states]
        missing = [r for r, path in enumerate(paths) if path is None]
        if missing:
            raise StateError(f"saved ranks {missing} have no ElasticDistributedSampler state to merge")
        samplers = []
        for state, path in zip(states, paths):
            for key in path:
                state = state[key]
            samplers.append(state)
        merged = merge_progress(samplers, rank, world_size)
        out = copy.deepcopy(states[0])
        _reset_counters(out)
        if not paths[0]:
            return merged
        holder = out
        for key in paths[0][:-1]:
            holder = holder[key]
        holder[paths[0][-1]] = merged
        return out
