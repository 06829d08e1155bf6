"""A failure on one rank in the middle of a state's collective steps (a module's state dict,
get or set, before an FSDP1 module whose state dict gathers across ranks) is raised on every
rank as a StateError naming that rank and the state key, never a hang (torch 2.7's FSDP1 state dicts fail
this way on a rank that holds no shard of a parameter)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ckptlib
from ckptlib._torch import parallel
from ckptlib.format import MANIFEST_NAME

pytestmark = pytest.mark.skipif(parallel.fsdp1_cpu_reason() is not None, reason=str(parallel.fsdp1_cpu_reason()))


def _fail(*_args, **_kwargs):
    raise RuntimeError("hook failed on rank 1")


class _Counter:
    """A stateful object (a local step, no collectives) that fails on rank 1 when told to."""

    def __init__(self, fail: str | None):
        self.fail, self.n = fail, 3

    def state_dict(self) -> dict:
        if self.fail == "stateful.state_dict":
            _fail()
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        if self.fail == "stateful.load_state_dict":
            _fail()
        self.n = sd["n"]


def _state(fail_in: str | None, order: str = "before-fsdp1") -> dict:
    """A plain module and a stateful object, either of which fails on rank 1 (in `fail_in`),
    and FSDP1 and its optimizer: the stateful object before the FSDP1 module, or between it and
    its optimizer (`order`), so that only the optimizer's own step is collective after it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    broken = nn.Linear(2, 2)
    if dist.get_rank() == 1 and fail_in == "state_dict":
        broken.register_state_dict_pre_hook(_fail)
    if dist.get_rank() == 1 and fail_in == "load_state_dict":
        broken.register_load_state_dict_pre_hook(_fail)
    model = FullyShardedDataParallel(nn.Linear(8, 8), device_id=torch.device("cpu"), use_orig_params=True)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optim.step()
    counter = _Counter(fail_in if dist.get_rank() == 1 else None)
    if order == "between-fsdp1-and-its-optimizer":
        return {"broken": broken, "model": model, "counter": counter, "optim": optim}
    return {"broken": broken, "counter": counter, "model": model, "optim": optim}


def _outcome(action) -> str:
    try:
        action()
        return "ok"
    except ckptlib.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def _save(uri: str, fail_in: str | None, order: str = "before-fsdp1") -> str:
    state = _state(fail_in, order)
    return _outcome(lambda: ckptlib.save(uri, state, step=1))


def _load(uri: str, fail_in: str | None, order: str = "before-fsdp1") -> str:
    state = _state(fail_in, order)
    return _outcome(lambda: ckptlib.load(uri, state))


_BEFORE = "before-fsdp1"
_BETWEEN = "between-fsdp1-and-its-optimizer"
_CASES = [
    ("save", "state_dict", _BEFORE),
    ("load", "state_dict", _BEFORE),
    ("load", "load_state_dict", _BEFORE),
    ("save", "stateful.state_dict", _BEFORE),
    ("load", "stateful.state_dict", _BEFORE),
    ("load", "stateful.load_state_dict", _BEFORE),
    # only the optimizer's step (get, or set: its applier) is collective after the failure
    ("save", "stateful.state_dict", _BETWEEN),
    ("load", "stateful.state_dict", _BETWEEN),
    ("load", "stateful.load_state_dict", _BETWEEN),
]


@pytest.mark.parametrize(
    "action,fail_in,order", _CASES, ids=[f"{a}-{f}" + ("" if o == _BEFORE else f"-{o}") for a, f, o in _CASES]
)
def test_a_rank_failing_before_an_fsdp1_state_dict_fails_every_rank(tmp_path, dist_run, action, fail_in, order):
    uri = str(tmp_path / "ckpt")
    if action == "load":
        assert dist_run(2, _save, uri, None, order, timeout=120) == ["ok", "ok"]
    outcomes = dist_run(2, _save if action == "save" else _load, uri, fail_in, order, timeout=120)
    what = {"state_dict": "Linear.state_dict()", "load_state_dict": "Linear.load_state_dict()"}.get(fail_in)
    key, what = ("broken", what) if what else ("counter", f"_Counter.{fail_in.split('.')[1]}()")
    for rank, outcome in enumerate(outcomes):
        assert outcome == f"StateError: rank 1: state[{key!r}]: {what} raised RuntimeError: hook failed on rank 1", (
            rank,
            outcome,
        )
    assert os.path.exists(os.path.join(uri, MANIFEST_NAME)) == (action == "load")
