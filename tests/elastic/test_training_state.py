"""Training states across a resize: saved at N ranks, loaded at M, bit-exact, then one more
step equal to a run that never checkpointed (`ckptlib.testing.matrices.training_states`)."""

from __future__ import annotations

import pytest

from ckptlib._torch import parallel
from ckptlib.testing.matrices import training_states as ts

pytestmark = [
    pytest.mark.elastic,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

# (scenario, save world size, load world size): every scenario shrinks or grows.
CASES = [
    ("gan", 2, 3),
    ("frozen", 3, 2),
    ("tied", 4, 3),
    ("param_groups", 2, 4),
    ("lr_scheduler", 4, 2),
    ("grad_scaler", 3, 1),
    ("compiled", 2, 3),
    ("activation_checkpointing", 3, 4),
    ("mixed_precision", 2, 3),
]


@pytest.mark.parametrize(("name", "n", "m"), [pytest.param(*c, id=f"save{c[1]}-load{c[2]}-{c[0]}") for c in CASES])
def test_training_state_survives_a_resize(name: str, n: int, m: int, tmp_path, dist_run):
    if name != "grad_scaler" and parallel.fsdp2_cpu_reason():
        pytest.skip(parallel.fsdp2_cpu_reason())
    uri = str(tmp_path / name)
    expected = dist_run(n, ts.save_scenario, uri, name)[0]
    problems = dist_run(m, ts.load_scenario, uri, name, expected)
    for rank, per_rank in enumerate(problems):
        assert per_rank == [], f"rank {rank}: {per_rank}"


def test_every_scenario_runs():
    assert sorted(name for name, _, _ in CASES) == sorted(ts.SCENARIOS)
