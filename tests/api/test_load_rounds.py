"""A load's per-rank checks (the entries `only=` selects, the keys `rename=`/`ignore_keys=` map,
the keys, shapes and dtypes against the checkpoint) are computed by each rank on its own and
agreed in one round: a check that fails on one rank only is raised on every rank naming that
rank, never a hang, and a load takes the same agreement rounds whatever options it is given."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib._runtime import agree as _dist

FAILURES = {
    "only": ("StateError", "only= names ['model'] that the state does not have"),
    "rename": ("StateError", "rename raised on checkpoint key"),
    "missing": ("MissingKeysError", "lacks keys the state asks for: model.extra"),
    "shape": ("ShapeMismatchError", "model.w: shape (9,) in the state, (8,) in the checkpoint"),
    "dtype": ("DtypeMismatchError", "model.w saved as float32, requested float64"),
}


def _save(path: str) -> None:
    ckptlib.save(path, {"model": {"w": torch.arange(8.0), "b": torch.ones(2)}, "epoch": 3})


def _state() -> dict:
    return {"model": {"w": torch.zeros(8), "b": torch.zeros(2)}, "epoch": 0}


def _load_failing_on_rank_1(path: str, check: str) -> tuple:
    state, options = _state(), {}
    failing = dist.get_rank() == 1
    if check == "only":
        options["only"] = ("model",)
        if failing:
            del state["model"]
    elif check == "rename":

        def rename(key: str) -> str:
            if failing:
                raise ValueError("no rename here")
            return key

        options["rename"] = rename
    elif failing and check == "missing":
        state["model"]["extra"] = torch.zeros(1)
    elif failing and check == "shape":
        state["model"]["w"] = torch.zeros(9)
    elif failing and check == "dtype":
        state["model"]["w"] = torch.zeros(8, dtype=torch.float64)
    try:
        ckptlib.load(path, state, **options)
    except ckptlib.CheckpointError as exc:
        return type(exc).__name__, exc.rank, str(exc)
    return ("ok",)


@pytest.mark.parametrize("check", list(FAILURES))
def test_a_check_failing_on_one_rank_fails_every_rank(tmp_path, dist_run, check):
    path = str(tmp_path / "c")
    _save(path)
    outcomes = dist_run(2, _load_failing_on_rank_1, path, check, timeout=90)
    kind, text = FAILURES[check]
    assert outcomes[0] == outcomes[1], outcomes  # the same error on both ranks
    assert outcomes[0][:2] == (kind, 1) and text in outcomes[0][2], outcomes


def _agreements_of_a_load(path: str, options: dict) -> int:
    """The agreement rounds of one load: `_dist.agree`, and `_dist.agree_sharing` (the same
    round, whose one collective also gathers each rank's bytes read)."""
    real, real_sharing, rounds = _dist.agree, _dist.agree_sharing, []

    def counted(fn, group=None, ballot=None, **kwargs):
        rounds.append(fn)
        return real(fn, group, ballot, **kwargs)

    def counted_sharing(fn, values, group=None):
        rounds.append(fn)
        return real_sharing(fn, values, group)

    _dist.agree, _dist.agree_sharing = counted, counted_sharing
    try:
        state = _state()
        result = ckptlib.load(path, state, **options)
    finally:
        _dist.agree, _dist.agree_sharing = real, real_sharing
    assert torch.equal(state["model"]["w"], torch.arange(8.0)) and state["epoch"] == 3
    assert len(result.storage_bytes_read_by_rank) == 2  # gathered in the last round, not one of its own
    return len(rounds)


def test_the_checks_take_one_round_whatever_the_options(tmp_path, dist_run):
    """Three agreements per load: the state's entries before their state dicts are built, every
    check of the load, and the values applied; `only`, `ignore_keys` and `rename` add none."""
    path = str(tmp_path / "c")
    _save(path)
    for options in ({}, {"only": ("model", "epoch")}, {"ignore_keys": ["model.nothing*"], "rename": {"x.": "y."}}):
        assert dist_run(2, _agreements_of_a_load, path, options, timeout=90) == [3, 3], options
