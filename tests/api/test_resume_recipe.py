"""The documented resume recipe is bit-exact with dropout (issue 37, item 7): the loss curve
of a run stopped at step K and resumed from its checkpoint (model, optimizer, `RNGState()`,
the data loader's position) continues exactly, when the DataLoader has a generator of its
own. The negative control is the pitfall the docs name: without `generator=`, creating the
loader's iterator after the load draws its seed from the global RNG that dropout uses, and
the curve after the resume differs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckptlib

STEPS, STOP = 12, 5
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def _run(path: str, *, own_generator: bool, stop: int | None = None, resume: bool = False) -> list[float]:
    """Train with dropout from a fresh process' state; save at `stop` (and return there), or
    load first (`resume`). Returns the losses of the steps it ran."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(1234 if resume else 0)  # a restarted job's process starts elsewhere
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=torch.Generator().manual_seed(7)),
        torch.randn(64, 1, generator=torch.Generator().manual_seed(8)),
    )
    generator = torch.Generator().manual_seed(3) if own_generator else None
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True, generator=generator)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optim": optim, "rng": ckptlib.RNGState(), "data": ckptlib.RankLocal(loader), "step": 0}
    if resume:
        ckptlib.load(path, state)
    batches = iter(loader)  # created after the load, as a training script does
    losses = []
    for step in range(state["step"], STEPS):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
        if step + 1 == stop:
            state["step"] = step + 1
            ckptlib.save(path, state)
            return losses
    return losses


@pytest.mark.parametrize("own_generator", [True, False], ids=["loader-generator", "global-rng"])
def test_a_resumed_run_continues_the_loss_curve_exactly(tmp_path, own_generator):
    whole = _run(str(tmp_path / "unused"), own_generator=own_generator)
    path = str(tmp_path / "c")
    before = _run(path, own_generator=own_generator, stop=STOP)
    after = _run(path, own_generator=own_generator, resume=True)
    assert before == whole[:STOP]
    assert len(after) == STEPS - STOP
    if own_generator:
        assert after == whole[STOP:]  # bit-exact: every float equal
    else:
        assert after != whole[STOP:]  # the pitfall: the iterator's seed came from the global RNG
