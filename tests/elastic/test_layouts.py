"""The layout matrix: save at layout A on N ranks, load at layout B on M ranks.

Layouts: plain, ddp, fsdp2, hsdp (2x2), tp, fsdp2+tp (2x2), fsdp1 (use_orig_params=True)
and fsdp1-flat (use_orig_params=False), of a small transformer with a tied head, uneven
shards and a zero-size shard (`ckptlib.testing.matrices.models`). Each case asserts the full model
and optimizer state after the load equals the saved state bit-exactly, the tie survives,
and one more step equals a never-checkpointed run.

A plain `pytest` runs the covering subset (every (save layout, load layout) pair once, each
layout saved and loaded at each of its world sizes); `pytest -m elastic` (or
`--full-matrix`) runs the full cross product. A save is made once per (layout, N) per test
process and reused by every load.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import ckptlib.testing
from ckptlib._torch import parallel
from ckptlib.testing import RankError
from ckptlib.testing.matrices import layout_matrix as lm
from ckptlib.testing.matrices import parallel_layouts as lay
from ckptlib.testing.matrices import validate

pytestmark = [
    pytest.mark.elastic,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

LAYOUTS = ("plain", "ddp", "fsdp2", "hsdp", "tp", "fsdp2+tp", "fsdp1", "fsdp1-flat")
COVERING = lm.covering_subset(LAYOUTS)
_COVERING_IDS = {case.id for case in COVERING}
CASES = [
    pytest.param(case, id=case.id, marks=() if case.id in _COVERING_IDS else pytest.mark.full_matrix)
    for case in lm.full_product(LAYOUTS)
]


def _skip_unavailable(*names: str) -> None:
    for name in names:
        reason = lay.get_layout(name).unavailable_reason("cpu")
        if reason:
            pytest.skip(f"{name}: {reason}")


@pytest.fixture(scope="session")
def saved_layouts(tmp_path_factory):
    """(layout, N) -> (checkpoint path, full state at save); saved on first use."""
    cache: dict[tuple, tuple[str, dict]] = {}
    root = tmp_path_factory.mktemp("layouts")

    def get(dist_run, layout: str, n: int):
        if (layout, n) not in cache:
            uri = str(root / f"save{n}-{layout}")
            cache[(layout, n)] = (uri, dist_run(n, lm.save_layout, uri, layout)[0])
        return cache[(layout, n)]

    return get


@pytest.mark.parametrize("case", CASES)
def test_save_layout_load_layout(case: lm.LayoutCase, saved_layouts, dist_run):
    _skip_unavailable(case.save_layout, case.load_layout)
    uri, expected = saved_layouts(dist_run, case.save_layout, case.save_ws)
    problems = dist_run(case.load_ws, lm.load_layout, uri, case.load_layout, expected)
    for rank, per_rank in enumerate(problems):
        assert per_rank == [], f"rank {rank}: {per_rank}"


def test_covering_subset_covers_every_pair_and_size():
    pairs = {(c.save_layout, c.load_layout) for c in COVERING}
    assert pairs == {(a, b) for a in LAYOUTS for b in LAYOUTS}
    assert len(COVERING) == len(LAYOUTS) ** 2
    for name in LAYOUTS:
        sizes = set(lay.get_layout(name).matrix_sizes)
        assert {c.save_ws for c in COVERING if c.save_layout == name} == sizes, name
        assert {c.load_ws for c in COVERING if c.load_layout == name} == sizes, name
    assert len(lm.full_product(LAYOUTS)) == 26 * 26


def test_layout_ids_name_both_layouts():
    assert lm.LayoutCase(4, "fsdp2+tp", 3, "fsdp2").id == "save4-fsdp2+tp-load3-fsdp2-adamw"


def test_2d_layouts_only_at_even_sizes_from_4():
    assert [n for n in range(1, 9) if lay.get_layout("hsdp").supports(n)] == [4, 6, 8]
    assert lay.get_layout("fsdp2+tp").mesh_shape(4) == (2, 2)
    with pytest.raises(ValueError, match="unknown layout 'fsdp3'"):
        lay.parse_layouts("fsdp2,fsdp3")


def test_ckpt_validate_layouts_names_both_layouts(capsys):
    from ckptlib import cli

    _skip_unavailable("fsdp2+tp", "tp")
    argv = ["validate", "--layouts", "fsdp2+tp,tp", "--world-sizes", "2,4", "--pairs", "covering", "--json"]
    rc = cli.main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] is True and doc["layouts"] == ["fsdp2+tp", "tp"]
    got = sorted((c["save_layout"], c["save_ws"], c["load_layout"], c["load_ws"]) for c in doc["cells"])
    want = sorted(
        (c.save_layout, c.save_ws, c.load_layout, c.load_ws) for c in lm.covering_subset(["fsdp2+tp", "tp"], [2, 4])
    )
    assert got == want and len(got) == 4
    report = validate.report_from_json(doc)
    table = report.table()
    assert set(table.splitlines()[0].split()[1:]) == {f"{b}@{m}" for _, _, b, m in got}
    assert table.count("pass") == 4 and "FAIL" not in table


def test_validate_layouts_table_names_failing_pairs():
    cells = [
        validate.Cell(4, 2, True, 0.5, "", "hsdp", "tp"),
        validate.Cell(4, 4, False, 1.0, "boom", "hsdp", "fsdp2+tp"),
    ]
    table = validate.Report("r", "layouts", "adamw", [2, 4], cells, ["hsdp", "tp", "fsdp2+tp"]).table()
    assert table.splitlines()[0].split() == ["save\\load", "tp@2", "fsdp2+tp@4"]
    assert table.splitlines()[1].split() == ["hsdp@4", "pass", "0.5s", "FAIL", "1.0s"]
    assert "save4-hsdp-load4-fsdp2+tp: boom" in table


def test_validate_rejects_unknown_layouts_and_sizes_no_layout_runs_at(capsys):
    from ckptlib import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["validate", "--layouts", "fsdp2,zero3"])
    assert info.value.code == 2 and "unknown layout 'zero3'" in capsys.readouterr().err
    assert cli.main(["validate", "--layouts", "hsdp", "--world-sizes", "1,2,3"]) == 2
    assert "2-D layouts run at even world sizes from 4" in capsys.readouterr().err


# --------------------------------------------------------------------------- a user's own model


class UserNet(torch.nn.Module):
    """What a user brings: their model, its TP plan and FSDP units, passed via ModelSpec."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(10, 16)
        self.down = torch.nn.Linear(16, 7)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def build_user_net(seed: int) -> UserNet:
    torch.manual_seed(seed)
    return UserNet()


def user_loss(model, step: int):
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
    return model(x).square().mean()


def user_tp_plan(model):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def user_fsdp_units(model):
    return [model.up]


USER_SPEC = ckptlib.testing.ModelSpec(
    build=build_user_net, loss=user_loss, tp_plan=user_tp_plan, fsdp_units=user_fsdp_units
)


@pytest.mark.parametrize(
    "case",
    [ckptlib.testing.LayoutCase(2, "tp", 4, "fsdp2+tp"), ckptlib.testing.LayoutCase(4, "hsdp", 2, "tp")],
    ids=lambda c: c.id,
)
def test_users_own_model_over_layout_pairs(case, tmp_path, dist_run):
    """docs/layouts.md's example: dist_run over layout pairs of a model that is not ckptlib's."""
    _skip_unavailable(case.save_layout, case.load_layout)
    uri = str(tmp_path / "ckpt")
    expected = dist_run(case.save_ws, ckptlib.testing.save_layout, uri, case.save_layout, spec=USER_SPEC)[0]
    problems = dist_run(case.load_ws, ckptlib.testing.load_layout, uri, case.load_layout, expected, spec=USER_SPEC)
    assert problems == [[]] * case.load_ws


def _fsdp1_state_dict_with_a_shardless_rank() -> str:
    """get_model_state_dict of FSDP1 over a Linear(4, 1) on 2 ranks: its sharded state dict cuts
    each parameter's dim 0 (1 row) into chunks, so rank 1 holds no shard of either."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(torch.nn.Linear(4, 1), device_id=torch.device("cpu"), use_orig_params=True)
    try:
        return "ok" if sorted(get_model_state_dict(model)) == ["bias", "weight"] else "keys differ"
    except Exception as exc:  # noqa: BLE001 - the text is the result
        return f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"


@pytest.mark.parametrize(
    "layout,failure",
    [
        ("fsdp2+tp", "FSDP+TP sharding does not support uneven sharding"),
        ("hsdp", "Cannot use ReduceOp.AVG with Gloo"),
    ],
)
def test_layout_gap_probe_matches_reality(layout, failure, tmp_path, dist_run):
    """Where parallel.layout_gap_reason says a layout cannot run on CPU (torch 2.7), a 4-rank
    save of the matrix model fails with torch's own error; where it can, the matrix runs it."""
    other = parallel.fsdp2_reason("cpu")
    if other or parallel.layout_gap_reason(layout) is None:
        pytest.skip(other or f"{layout} runs on this torch: test_save_layout_load_layout covers it")
    with pytest.raises(RankError, match=re.escape(failure)):
        dist_run(4, lm.save_layout, str(tmp_path / "ckpt"), layout)


def test_fsdp1_gap_probe_matches_reality(dist_run):
    """The FSDP1 gap (DCP asks a shardless rank's ShardedTensor is_meta, which raises) is
    probed exactly where it exists."""
    if parallel.fsdp1_cpu_reason():
        pytest.skip(parallel.fsdp1_cpu_reason())
    outcomes = dist_run(2, _fsdp1_state_dict_with_a_shardless_rank)
    if parallel.layout_gap_reason("fsdp1") is None:
        assert outcomes == ["ok", "ok"]
    else:
        assert outcomes[0] == "ok" and outcomes[1].startswith(
            "rank 1: NotImplementedError: Only single local shard is supported."
        ), outcomes
