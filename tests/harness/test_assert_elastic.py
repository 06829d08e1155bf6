"""`ckptlib.testing.assert_elastic` on a job this suite uses nowhere else, and what it says when
the job is not elastic or its own code fails.

The job: a 1-D conv net over token embeddings with BatchNorm (running statistics and an int64
batch counter: buffers, not parameters), dropout, SGD with Nesterov momentum under OneCycleLR,
a step counter object and the per-rank RNG state. Negative controls: an object whose
`load_state_dict` forgets (after-load difference), hidden state outside the checkpoint
(train-after-load difference), and factories that raise on one rank (a SpecFactoryError naming
that rank, with the traceback, instead of a hang).
"""

from __future__ import annotations

import dataclasses
import os
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ckptlib
from ckptlib.testing import ElasticAssertionError, SpecError, SpecFactoryError, TrainingSpec, assert_elastic, load_spec

VOCAB, CHANNELS, LENGTH = 23, 6, 9


class ConvTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CHANNELS)
        self.conv = nn.Conv1d(CHANNELS, 10, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm1d(10)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(10, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)
        x = self.drop(F.relu(self.norm(self.conv(x))))
        return self.out(x.transpose(1, 2))


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ConvTagger()


def fsdp_units(model: ConvTagger) -> list[nn.Module]:
    return [model.conv, model.out]


def build_optimizers(model: nn.Module) -> dict:
    return {"sgd": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)}


def build_schedulers(optimizers: dict) -> dict:
    return {"onecycle": torch.optim.lr_scheduler.OneCycleLR(optimizers["sgd"], max_lr=0.1, total_steps=20)}


class StepCounter:
    def __init__(self):
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.steps = sd["steps"]


def build_state(rank: int, world_size: int) -> dict:
    return {"counter": StepCounter(), "rng": ckptlib.RNGState()}


def train_step(training, step: int) -> None:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (4, LENGTH), generator=gen)
    tags = torch.randint(0, 5, (4, LENGTH), generator=gen)
    F.cross_entropy(training.model(tokens).reshape(-1, 5), tags.reshape(-1)).backward()
    training.optimizers["sgd"].step()
    training.optimizers["sgd"].zero_grad(set_to_none=True)
    training.schedulers["onecycle"].step()
    training.extras["counter"].steps += 1


CONV_TAGGER = TrainingSpec(
    build_model=build_model,
    build_optimizers=build_optimizers,
    build_schedulers=build_schedulers,
    build_state=build_state,
    train_step=train_step,
    fsdp_units=fsdp_units,
    layouts=("fsdp2", "ddp"),
    name="conv-tagger",
)


@pytest.mark.elastic
@pytest.mark.timeout(900)
def test_conv_tagger_resumes_at_every_world_size_and_layout():
    report = assert_elastic(CONV_TAGGER, world_sizes=(1, 3))
    assert report.ok and report.spec == "conv-tagger" and report.layouts == ["fsdp2", "ddp"]
    ids = sorted(c.id for c in report.cells)
    assert len(ids) == 16 and "save3-ddp-load1-fsdp2" in ids and "save1-fsdp2-load3-ddp" in ids


# --------------------------------------------------------------------------- negative controls


class Forgetful(StepCounter):
    def load_state_dict(self, sd: dict) -> None:
        pass  # the bug: a resumed counter starts over


def _forgetful_state(rank: int, world_size: int) -> dict:
    return {"counter": Forgetful()}


HIDDEN = {"scale": 1.0}  # training state that no checkpoint holds


def _hidden_step(training, step: int) -> None:
    HIDDEN["scale"] *= 1.5
    with torch.no_grad():
        for param in training.model.parameters():
            param.mul_(HIDDEN["scale"] / (1 + HIDDEN["scale"]))
    train_step(training, step)


def test_a_state_that_does_not_come_back_fails_after_load():
    spec = dataclasses.replace(CONV_TAGGER, build_state=_forgetful_state, layouts=("ddp",))
    with pytest.raises(ElasticAssertionError) as info:
        assert_elastic(spec, world_sizes=(1, 2))
    report = info.value.report
    assert [c.ok for c in report.cells] == [False] * 4
    assert all("after-load.counter.steps: 2 vs 0" in c.error for c in report.cells)
    assert "FAIL" in str(info.value) and "save2-ddp-load1-ddp" in str(info.value)


def test_state_outside_the_checkpoint_fails_the_next_step():
    spec = dataclasses.replace(CONV_TAGGER, train_step=_hidden_step, layouts=("ddp",))
    with pytest.raises(ElasticAssertionError) as info:
        assert_elastic(spec, world_sizes=(2,))
    (cell,) = info.value.report.cells
    assert "train-after-load.full.model." in cell.error and "after-load.full" not in cell.error.replace(
        "train-after-load", ""
    )


def _build_fails_on_rank1(seed: int) -> nn.Module:
    if dist.get_rank() == 1:
        raise RuntimeError(f"no weights for seed {seed} on this rank")
    return build_model(seed)


def _step_fails_on_rank1(training, step: int) -> None:
    if training.rank == 1:
        raise KeyError("batch")
    train_step(training, step)


@pytest.mark.parametrize(
    "spec,where,what",
    [
        (dataclasses.replace(CONV_TAGGER, build_model=_build_fails_on_rank1), "build_model(0)", "RuntimeError"),
        (dataclasses.replace(CONV_TAGGER, train_step=_step_fails_on_rank1), "train_step", "KeyError"),
    ],
    ids=["build-model", "train-step"],
)
def test_a_factory_that_fails_on_one_rank_names_it_with_its_traceback(spec, where, what):
    """The other ranks do not hang in a collective: the run stops with the user's error."""
    with pytest.raises(SpecFactoryError) as info:
        assert_elastic(spec, world_sizes=(2,), timeout=180)
    text = str(info.value)
    assert text.startswith(f"rank 1: {where}") and f"raised {what}" in text
    assert "Traceback (most recent call last)" in text and os.path.basename(__file__) in text
    assert info.value.rank == 1


def loss_of_nothing(model, step):
    return model(step)


def test_spec_references(tmp_path, monkeypatch):
    job = tmp_path / "job.py"
    job.write_text(
        textwrap.dedent(
            """
            import torch
            LAYOUTS = ("ddp", "plain")
            STEPS = 4
            def build_model(seed):
                torch.manual_seed(seed)
                return torch.nn.Linear(3, 2)
            def loss(model, step):
                return model(torch.ones(1, 3) * step).sum()
            def make():
                return __import__("ckptlib.testing", fromlist=["x"]).TrainingSpec(build_model, loss=loss, name="made")
            """
        )
    )
    module_spec = load_spec(str(job))
    assert module_spec.layouts == ("ddp", "plain") and module_spec.steps == 4 and module_spec.loss is not None
    assert load_spec(f"{job}:make").name == "made"
    monkeypatch.chdir(tmp_path)
    assert load_spec("job").steps == 4  # the current directory is importable
    with pytest.raises(SpecError, match=r"job.py:nothing: .* has no attribute 'nothing'"):
        load_spec(f"{job}:nothing")
    with pytest.raises(SpecError, match=r"no build_model function \(found: loss\)"):
        assert_elastic(type("Namespace", (), {"loss": loss_of_nothing})())
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nraise ImportError('the cluster module is missing')\n")
    with pytest.raises(SpecError) as info:
        load_spec(f"{broken}:SPEC")
    assert "importing" in str(info.value) and "ImportError: the cluster module is missing" in str(info.value)
    assert "Traceback (most recent call last)" in str(info.value)
    with pytest.raises(SpecError, match="no such file"):
        load_spec(str(tmp_path / "absent.py"))
    with pytest.raises(SpecError, match="No module named 'no_such_pkg'"):
        load_spec("no_such_pkg.training:SPEC")
