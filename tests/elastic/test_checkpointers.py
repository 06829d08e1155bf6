"""`ckpt validate --checkpointer` and `assert_elastic(checkpointer=...)`: the N->M matrix through
a checkpointer other than ckptlib's manager.

Plain DCP (`ckptlib.testing.checkpointers:DCPCheckpointer`) passes 2->1 and 1->2 here (the
1..4 x 1..4 matrix is in the extended run), its per-rank state reported as not carried. Each
checkpointer of `helpers.checkpointers` has one real bug, and each pair it breaks names the
first key and the rank that differ: rank 0 alone saving its shards, an optimizer started over
after the load, the wrong step returned, per-rank state saved under one shared key.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import checkpointers as faulty

import ckptlib
from ckptlib import cli
from ckptlib.testing import ElasticAssertionError, TrainingSpec, assert_elastic
from ckptlib.testing.checkpointers import CheckpointerError, DCPCheckpointer, carried, resolve
from ckptlib.testing.checkpointers.plain_dcp import newest_step

DCP = "ckptlib.testing.checkpointers:DCPCheckpointer"
DIFF = r"values differ \(max abs diff [0-9.e+-]+\)"


def _validate(capsys, *argv: str) -> tuple[int, dict]:
    rc = cli.main(["validate", "--json", *argv])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def _errors(doc: dict) -> dict:
    return {f"{c['save_ws']}->{c['load_ws']}": c["error"] for c in doc["cells"]}


def test_plain_dcp_saves_at_2_and_loads_at_1_and_back(capsys):
    rc, doc = _validate(capsys, "--world-sizes", "1,2", "--checkpointer", DCP)
    assert rc == 0 and doc["ok"] is True and doc["checkpointer"] == DCP
    assert _errors(doc) == {"1->1": "", "1->2": "", "2->1": "", "2->2": ""}
    assert [c["not_carried"] for c in doc["cells"]] == [[]] * 4  # model, optimizer and step: all carried


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "argv",
    [(), ("--layouts", "plain,ddp,fsdp2,tp,hsdp,fsdp2+tp", "--pairs", "covering")],
    ids=["fsdp2", "layouts-covering"],
)
def test_plain_dcp_passes_every_pair_of_1_to_4(argv, capsys):
    """Extended run (about 1 and 3 minutes here): DCP genuinely reshards every pair."""
    rc, doc = _validate(capsys, "--world-sizes", "1,2,3,4", "--checkpointer", DCP, "--timeout", "1400", *argv)
    assert [c for c in doc["cells"] if not c["ok"]] == [] and rc == 0
    assert len(doc["cells"]) == (16 if not argv else 36)  # covering: one case per layout pair


#: (checkpointer, {pair: the first difference its report names, a regular expression}); a pair
#: not named passes.
FAULTS = {
    "rank0-shard-only": (
        "helpers.checkpointers:RankZeroShardOnly",
        {
            "1->2": rf"rank 0: after-load\.shard\.model\.inp\.weight: {DIFF}",
            "2->1": rf"rank 0: after-load\.shard\.model\.inp\.weight: {DIFF}",
            "2->2": rf"rank 1: after-load\.shard\.model\.inp\.weight: {DIFF}",  # rank 0's own shards came back
        },
    ),
    "fresh-optimizer": (
        "helpers.checkpointers:FreshOptimizer",
        {
            pair: r"rank 0: after-load\.shard\.optim\.state\.inp\.weight\.step: values differ \(max abs diff 1\)"
            for pair in ("1->1", "1->2", "2->1", "2->2")
        },
    ),
    "next-step": (
        "helpers.checkpointers:NextStep",
        {pair: r"rank 0: step: loaded 3, expected 2" for pair in ("1->1", "1->2", "2->1", "2->2")},
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_faulty_checkpointer_fails_naming_the_first_key_and_rank(fault, capsys):
    ref, first = FAULTS[fault]
    rc, doc = _validate(capsys, "--world-sizes", "1,2", "--checkpointer", ref)
    assert rc == 1 and doc["ok"] is False
    errors = _errors(doc)
    assert sorted(pair for pair, error in errors.items() if error) == sorted(first)
    for pair, pattern in first.items():
        assert re.fullmatch(pattern, errors[pair].split("; ")[0]), (pair, errors[pair])


def test_the_table_names_the_checkpointer_and_the_first_difference(capsys):
    rc = cli.main(
        ["validate", "--world-sizes", "2", "--no-progress", "--checkpointer", "helpers.checkpointers:NextStep"]
    )
    out = capsys.readouterr().out.splitlines()
    assert rc == 1
    assert out[0] == (
        "ckpt validate: root=(temporary directory on local disk) wrap=fsdp2 optim=adamw "
        "checkpointer=helpers.checkpointers:NextStep backend=gloo"
    )
    assert out[3:] == ["save2-load2: rank 0: step: loaded 3, expected 2", "SOME PAIRS FAILED"]


def test_help_names_the_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--checkpointer MODULE:ATTR save and load through this checkpointer instead of ckptlib's" in out
    assert "made the default process group meanwhile" in out


def test_a_checkpointer_without_process_group_runs_every_pair_on_its_ranks(capsys):
    """Its calls see the pair's ranks as the default group: dist.get_world_size() is N."""
    rc, doc = _validate(capsys, "--world-sizes", "1,2", "--checkpointer", "helpers.checkpointers:NoGroup")
    assert rc == 0 and _errors(doc) == {"1->1": "", "1->2": "", "2->1": "", "2->2": ""}


@pytest.mark.parametrize(
    "ref,message",
    [
        ("no_such_module:DCP", "checkpointer 'no_such_module:DCP': cannot import 'no_such_module': "),
        ("helpers.checkpointers", "checkpointer 'helpers.checkpointers': expected 'module:attr'"),
        (
            "helpers.checkpointers:Absent",
            "checkpointer 'helpers.checkpointers:Absent': module 'helpers.checkpointers' has no 'Absent'",
        ),
        (
            "helpers.checkpointers:NOT_ONE",
            "checkpointer 'helpers.checkpointers:NOT_ONE': str has no save(root, step, state) and load(root, state)",
        ),
    ],
    ids=["no-module", "no-attr", "absent-attr", "not-a-checkpointer"],
)
def test_a_reference_that_names_no_checkpointer_is_a_usage_error(ref, message, capsys):
    """Checked before any rank starts: exit 2, one line on stderr."""
    rc = cli.main(["validate", "--world-sizes", "2", "--checkpointer", ref])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"ckpt validate: error: {message}") and err.count("\n") == 1


# --------------------------------------------------------------------------- carries


class Counter:
    def __init__(self):
        self.steps = 0

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, sd):
        self.steps = sd["steps"]


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Dropout(0.3), torch.nn.Linear(7, 2))


def build_state(rank: int, world_size: int) -> dict:
    return {"counter": Counter(), "rng": ckptlib.RNGState()}


def train_step(training, step: int) -> None:
    data = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
    training.model(data).square().mean().backward()  # dropout draws from this rank's RNG
    training.optimizers["optim"].step()
    training.optimizers["optim"].zero_grad(set_to_none=True)
    training.extras["counter"].steps += 1


#: Per-rank RNG (dropout) and a replicated counter: what DCP carries and what it does not.
DROPOUT_JOB = TrainingSpec(
    build_model=build_model, build_state=build_state, train_step=train_step, layouts=("ddp",), name="dropout"
)


@pytest.mark.elastic
def test_plain_dcp_reports_per_rank_state_as_not_carried():
    report = assert_elastic(DROPOUT_JOB, world_sizes=(1, 2), checkpointer=DCPCheckpointer())
    assert report.checkpointer == "dcp" and [c.not_carried for c in report.cells] == [["rng"]] * 4
    assert report.table().splitlines()[-1] == "not carried by dcp (not compared): rng"


@pytest.mark.elastic
def test_per_rank_state_claimed_but_shared_fails_on_the_rank_that_lost_its_own():
    """DCP keeps one copy of a value every rank saves under one key: rank 1 gets rank 0's RNG."""
    with pytest.raises(ElasticAssertionError) as info:
        assert_elastic(DROPOUT_JOB, world_sizes=(2,), checkpointer=faulty.PerRankShared())
    (cell,) = info.value.report.cells
    assert cell.not_carried == []
    assert re.fullmatch(
        r"rank 1: after-load\.rank1\.rng\(saved\)\.python\[1\]\[1\]: \d+ vs \d+", cell.error.split("; ")[0]
    ), cell.error


def test_carries_names_the_entries_and_is_checked():
    state = {"model": torch.nn.Linear(2, 2), "rng": ckptlib.RNGState(), "step": 0}
    assert carried(DCPCheckpointer(), state) == {"model", "step"}
    assert carried(resolve("ckptlib.testing.checkpointers:CkptlibCheckpointer"), state) == {"model", "rng", "step"}
    declared = type("Declared", (), {"carries": ("model", "absent"), "save": print, "load": print})()
    assert carried(declared, state) == {"model"}
    bad = type("Bad", (), {"carries": "model", "save": print, "load": print, "name": "bad"})()
    with pytest.raises(CheckpointerError, match=r"^checkpointer bad: carries must name state entries, got 'model'$"):
        carried(bad, state)


def test_newest_step_lists_committed_steps_only(tmp_path):
    assert newest_step(str(tmp_path / "absent")) is None
    for name in ("step-3", "step-12", "step-40", "step-x", "other"):
        (tmp_path / name).mkdir()
    for name in ("step-3", "step-12", "step-x"):
        (tmp_path / name / ".metadata").write_bytes(b"")
    assert newest_step(str(tmp_path)) == 12  # step-40 has no .metadata: DCP never finished it


def test_plain_dcp_refuses_what_it_cannot_save(tmp_path):
    two = {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)}
    with pytest.raises(
        CheckpointerError, match=r"^checkpointer dcp: the state needs exactly one nn.Module, found \['a', 'b'\]$"
    ):
        DCPCheckpointer().save(str(tmp_path), 1, two)
    with pytest.raises(
        CheckpointerError, match=r"^checkpointer dcp: s3://bucket/run: plain DCP here writes local paths only$"
    ):
        DCPCheckpointer().save("s3://bucket/run", 1, {"model": torch.nn.Linear(2, 2)})


# --------------------------------------------------------------------------- every entry point


def _fsdp2_job():
    import dataclasses

    return dataclasses.replace(DROPOUT_JOB, layouts=("fsdp2",), name="dropout-fsdp2")


@pytest.mark.parametrize("entry", ["validate-layouts", "assert-elastic-spec"])
def test_rank_zero_shards_only_names_rank_1_through_every_entry_point(entry, capsys):
    """The same bug through `--layouts` (the small transformer) and a spec (`assert_elastic`) as
    through the default pairs above: rank 0's shards came back, rank 1's did not."""
    ref = "helpers.checkpointers:RankZeroShardOnly"
    if entry == "validate-layouts":
        rc, doc = _validate(capsys, "--world-sizes", "2", "--layouts", "fsdp2", "--checkpointer", ref)
        assert rc == 1
        (error,) = [c["error"] for c in doc["cells"]]
    else:
        with pytest.raises(ElasticAssertionError) as info:
            assert_elastic(_fsdp2_job(), world_sizes=(2,), checkpointer=ref)
        (cell,) = info.value.report.cells
        assert cell.not_carried == ["rng"]
        error = cell.error
    key = "embed.weight" if entry == "validate-layouts" else "0.weight"  # the model's first parameter
    assert re.fullmatch(rf"rank 1: after-load\.shard\.model\.{key}: {DIFF}", error.split("; ")[0]), error
