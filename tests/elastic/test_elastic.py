"""The elastic matrix: save at N ranks, load at M, for every N, M in 1..4 × wrapping × optimizer.

Each cell asserts the full model and optimizer state after the load equals the state at
save time bit-exactly, and that one more training step gives the same parameters and
optimizer state as a run that reached that state without a checkpoint. A save is made
once per (N, wrapping, optimizer) per test process and reused by the four loads.
"""

from __future__ import annotations

import pytest

from ckptlib._torch import parallel
from ckptlib.testing.matrices import matrix as mx

pytestmark = pytest.mark.elastic

SIZES = (1, 2, 3, 4)
CASES = [mx.Case(n, m, w, o) for w in mx.WRAPPINGS for o in mx.OPTIMIZERS for n in SIZES for m in SIZES]


def _skip_unsupported(wrap: str) -> None:
    if wrap == "fsdp2" and parallel.fsdp2_cpu_reason():
        pytest.skip(parallel.fsdp2_cpu_reason())


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """(N, wrap, optim) -> (checkpoint path, full state at save); saved on first use."""
    cache: dict[tuple, tuple[str, dict]] = {}
    root = tmp_path_factory.mktemp("elastic")

    def get(dist_run, n: int, wrap: str, optim: str):
        key = (n, wrap, optim)
        if key not in cache:
            uri = str(root / f"save{n}-{wrap}-{optim}")
            expected = dist_run(n, mx.save_side, uri, wrap, optim)
            cache[key] = (uri, expected[0])
        return cache[key]

    return get


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_save_n_load_m(case: mx.Case, saved, dist_run):
    _skip_unsupported(case.wrap)
    uri, expected = saved(dist_run, case.save_ws, case.wrap, case.optim)
    problems = dist_run(case.load_ws, mx.load_side, uri, case.wrap, case.optim, expected)
    for rank, per_rank in enumerate(problems):
        assert per_rank == [], f"rank {rank}: {per_rank}"


def test_saved_state_differs_from_fresh_model():
    """Guards the matrix against a vacuous pass: loads start from a different model."""
    fresh, trained = mx.build_model(1), mx.build_model(0)
    assert mx.differences(trained.state_dict(), fresh.state_dict())


CROSS = [
    mx.Case(4, 2, "fsdp2", "adamw"),
    mx.Case(3, 4, "fsdp2", "sgd"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id + "-via-manager") for c in CROSS])
def test_manager_round_trip_across_world_sizes(case: mx.Case, tmp_path, dist_run):
    _skip_unsupported(case.wrap)
    root = str(tmp_path / "run")
    expected = dist_run(case.save_ws, mx.save_side, root, case.wrap, case.optim, manager=True)[0]
    problems = dist_run(case.load_ws, mx.load_side, root, case.wrap, case.optim, expected, manager=True)
    assert problems == [[]] * case.load_ws
