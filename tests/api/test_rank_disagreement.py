"""Ranks that disagree in a collective save or load: one `RanksDisagreeError` (a StateError) on
every rank, listing the ranks and what each has (the step, overwrite=; each key's kind, dtype
and shape),
raised before anything is written: no step directory, no file, `latest` and the lock as before.

What may differ between ranks: the keys themselves (pipeline stages hold different modules),
but a key several ranks hold must be the same kind (a tensor, a sharded tensor, an object) with
the same dtype and (global) shape on all of them, and a sharded tensor's pieces must cover it.
Replicated values that differ (the same shape, other numbers) are saved from one rank (the one
DCP's dedup picks): checked only under CKPTLIB_CHECK_REPLICAS=1.

Before: different steps blamed storage ("rank 1's shard is missing") and left a stray step
directory; a tensor whose shape or dtype differed between ranks "succeeded" and silently kept
one rank's copy; overwrite= on one rank only was the coordinator's word, silently.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import CheckpointManager
from ckptlib.errors import RanksDisagreeError  # noqa: F401


def _files(root: str) -> list[str]:
    out = []
    for here, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(here, n), root) for n in names]
    return sorted(out)


def _state(case: str) -> dict:
    rank = dist.get_rank()
    other = rank == 1
    w = torch.arange(4.0)
    if case == "shape" and other:
        w = torch.arange(5.0)
    if case == "dtype" and other:
        w = torch.arange(4.0, dtype=torch.float64)
    state = {"model": {"w": w, "b": torch.ones(2)}, "epoch": 3}
    if case == "kind" and other:
        state["model"]["b"] = 7
    if case == "sharded-missing":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if not other:  # rank 1 lacks its piece of a tensor sharded over both ranks
            state["model"]["sharded"] = DTensor.from_local(
                torch.ones(2, 3), mesh, [Shard(0)], run_check=False, shape=torch.Size([4, 3]), stride=(3, 1)
            )
    return state


def _outcome(action) -> tuple:
    try:
        action()
        return ("ok",)
    except ckptlib.CheckpointError as exc:
        return type(exc).__name__, str(exc), getattr(exc, "ranks", None), getattr(exc, "keys", None)


def _save(root: str, case: str, how: str) -> tuple:
    step = 5 + dist.get_rank() if case == "step" else 5
    overwrite = case == "overwrite" and dist.get_rank() == 1  # acted on by the coordinator alone
    state = _state(case)
    if how == "manager":
        mgr = CheckpointManager(root)
        outcome = _outcome(lambda: mgr.save(step, state, overwrite=overwrite))
        return outcome, mgr.lock_holder() is None
    if how == "replan":  # a second save whose state changed on one rank: the plan cache must not reuse
        mgr = CheckpointManager(root)
        mgr.save(1, {"model": {"w": torch.arange(4.0), "b": torch.ones(2)}, "epoch": 3})
        outcome = _outcome(lambda: mgr.save(step, state))
        return outcome, mgr.lock_holder() is None
    if how.startswith("async-"):
        mode = how.split("-", 1)[1]
        target = os.path.join(root, "ckpt")
        save = ckptlib.async_save
        return _outcome(lambda: save(target, state, step=step, async_mode=mode, overwrite=overwrite).wait()), True
    return _outcome(lambda: ckptlib.save(os.path.join(root, "ckpt"), state, step=step, overwrite=overwrite)), True


EXPECTED = {
    "step": (["step"], "rank 0: 5; rank 1: 6"),
    "overwrite": (["overwrite"], "rank 0: False; rank 1: True"),
    "shape": (["model.w"], "model.w: rank 0: tensor float32 (4,); rank 1: tensor float32 (5,)"),
    "dtype": (["model.w"], "model.w: rank 0: tensor float32 (4,); rank 1: tensor float64 (4,)"),
    "kind": (["model.b"], "model.b: rank 0: tensor float32 (2,); rank 1: object"),
    "sharded-missing": (["model.sharded"], "model.sharded: sharded float32 (4, 3) held by rank 0 only"),
}


def _expected_files(how: str) -> list[str]:
    """What the root holds after the refused save: nothing, or the step the first save committed."""
    if how != "replan":
        return []
    return [f"step_0000000001/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp", "ckptlib.json")]


HOWS = ["save", "manager", "replan", "async-thread", "async-process"]


# every case with a plain save; the step, shape and dtype cases with every other way to save;
# overwrite= with a manager and a thread's async save too
CASES = [
    (case, how)
    for how in HOWS
    for case in EXPECTED
    if how == "save"
    or case in ("step", "shape", "dtype")
    or (case == "overwrite" and how in ("manager", "async-thread"))
]


@pytest.mark.parametrize("case,how", CASES, ids=[f"{case}-{how}" for case, how in CASES])
def test_ranks_that_disagree_fail_alike_before_anything_is_written(tmp_path, dist_run, case, how):
    root = str(tmp_path / "root")
    os.makedirs(root)
    results = dist_run(2, _save, root, case, how, timeout=120)
    (outcome0, unlocked0), (outcome1, _) = results
    assert outcome0 == outcome1, results  # the same error on every rank
    kind, text, ranks, keys = outcome0
    want_keys, detail = EXPECTED[case]
    assert kind == "RanksDisagreeError" and detail in text, text
    assert ranks == [0, 1] and keys == want_keys, (ranks, keys)
    assert unlocked0 and _files(root) == _expected_files(how), _files(root)  # no new step directory, no lock


def _load_step(root: str) -> tuple:
    mgr = CheckpointManager(root)
    return _outcome(lambda: mgr.load({"w": torch.zeros(3)}, step=1 + dist.get_rank()))


def test_a_load_of_different_steps_fails_alike(tmp_path, dist_run):
    root = str(tmp_path / "root")
    mgr = CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((3,), float(step))})
    results = dist_run(2, _load_step, root, timeout=120)
    assert results[0] == results[1], results
    kind, text, ranks, keys = results[0]
    assert kind == "RanksDisagreeError" and "rank 0: 1; rank 1: 2" in text and ranks == [0, 1] and keys == ["step"]


def _replicas(path: str, check: bool) -> tuple:
    if check:
        os.environ["CKPTLIB_CHECK_REPLICAS"] = "1"
    state = {"model": {"w": torch.full((4,), float(dist.get_rank())), "b": torch.ones(2)}, "epoch": dist.get_rank()}
    return _outcome(lambda: ckptlib.save(path, state))


def test_replicated_values_that_differ_are_checked_under_the_debug_flag(tmp_path, dist_run):
    results = dist_run(2, _replicas, str(tmp_path / "checked"), True, timeout=120)
    assert results[0] == results[1], results
    kind, text, ranks, keys = results[0]
    assert kind == "RanksDisagreeError" and keys == ["epoch", "model.w"] and ranks == [0, 1], results
    assert "CKPTLIB_CHECK_REPLICAS" in text
    assert not os.path.exists(tmp_path / "checked") or _files(str(tmp_path / "checked")) == []
    # without the flag one rank's copy of each is saved (documented)
    assert dist_run(2, _replicas, str(tmp_path / "unchecked"), False, timeout=120) == [("ok",), ("ok",)]
    got = {"model": {"w": torch.zeros(4), "b": torch.zeros(2)}, "epoch": -1}
    ckptlib.load(str(tmp_path / "unchecked"), got)
    assert any(torch.equal(got["model"]["w"], torch.full((4,), float(r))) for r in (0, 1)) and got["epoch"] in (0, 1)
