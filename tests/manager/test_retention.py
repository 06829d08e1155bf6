"""Retention policies: exact step sets on disk after every save, locally, on S3 and in `ckpt gc`.

Axes: the policy (KeepLast n, KeepEvery k, KeepBest k by a metric, combinations with |),
the storage (local, S3 through moto), and the history (plain, a rollback, steps lacking
the metric, ties).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, KeepBest, KeepEvery, KeepLast, StalePointerWarning, StateError, cli
from ckptlib.manager.policies import AnyOf, StepRecord, to_delete


def _dirs(root) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("step_"))


def _state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def _records(*pairs) -> list[StepRecord]:
    return [StepRecord(step, metrics) for step, metrics in pairs]


# ---------------------------------------------------------------- the policies alone


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_keep_last_after_every_save(tmp_path, n):
    """keep_last=n: after save k the root holds exactly steps max(1, k-n+1)..k (fewer than n while k < n)."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=n)
    for k in range(1, 9):
        mgr.save(k, _state(k))
        assert _dirs(root) == list(range(max(1, k - n + 1), k + 1)), f"after saving step {k}"
        assert mgr.steps() == _dirs(root) and mgr.latest() == k
        assert os.readlink(root / "latest") == f"step_{k:010d}"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_keep_last_policy_object_equals_shorthand(tmp_path, n):
    a, b = tmp_path / "a", tmp_path / "b"
    short, policy = CheckpointManager(a, keep_last=n), CheckpointManager(b, retention=KeepLast(n))
    for k in (2, 4, 6, 8, 10, 12):
        short.save(k, _state(k))
        policy.save(k, _state(k))
        assert _dirs(a) == _dirs(b)


@pytest.mark.parametrize(
    "policy, expected",
    [
        (KeepLast(2), {9, 10}),
        (KeepEvery(4), {0, 4, 8}),
        (KeepBest(2, "loss"), {3, 9}),  # the two 1.0 losses; step 10 has none
        (KeepBest(1, "loss"), {9}),  # a tie at 1.0: the newer step
        (KeepBest(2, "loss", mode="max"), {8, 5}),  # 9.0, then the 7.0 tie of steps 4 and 5: the newer
        (KeepLast(1) | KeepEvery(5), {0, 5, 10}),
        (KeepLast(1) | KeepBest(1, "acc", mode="max"), {7, 10}),
        (KeepEvery(4) | KeepBest(1, "loss") | KeepLast(2), {0, 4, 8, 9, 10}),
    ],
    ids=[
        "last2",
        "every4",
        "best2-loss-min",
        "best1-loss-tie",
        "best2-loss-max",
        "last1|every5",
        "last1|best1-acc-max",
        "every4|best1|last2",
    ],
)
def test_policy_keeps(policy, expected):
    losses = {0: 5.0, 1: 4.0, 2: 3.0, 3: 1.0, 4: 7.0, 5: 7.0, 6: 2.0, 7: 2.5, 8: 9.0, 9: 1.0, 10: None}
    records = [StepRecord(s, {"loss": v} if v is not None else {}) for s, v in losses.items()]
    records[7] = StepRecord(7, {"loss": 2.5, "acc": 0.9})
    records[3] = StepRecord(3, {"loss": 1.0, "acc": 0.9})  # a tie on acc: the newer step (7) wins
    assert policy.keep(records) == expected


def test_keep_best_ties_prefer_newer_steps():
    records = _records((1, {"loss": 0.5}), (2, {"loss": 0.5}), (3, {"loss": 0.5}), (4, {"loss": 0.7}))
    assert KeepBest(1, "loss").keep(records) == {3}
    assert KeepBest(2, "loss").keep(records) == {2, 3}
    assert KeepBest(4, "loss").keep(records) == {1, 2, 3, 4}
    assert KeepBest(1, "loss", mode="max").keep(records) == {4}


@pytest.mark.parametrize(
    "metrics",
    [{}, {"other": 1.0}, {"loss": None}, {"loss": "low"}, {"loss": True}, {"loss": float("nan")}, {"loss": math.inf}],
    ids=["none", "other-metric", "null", "string", "bool", "nan", "inf"],
)
def test_keep_best_never_ranks_steps_without_a_usable_value(metrics):
    records = _records((1, metrics), (2, {"loss": 3.0}), (3, metrics), (4, {"loss": 2.0}), (5, metrics))
    assert KeepBest(5, "loss").keep(records) == {2, 4}
    assert KeepBest(1, "loss").keep(records) == {4}
    assert KeepBest(1, "loss").keep(_records((1, metrics))) == set()


def test_combination_flattens_and_validates():
    combo = KeepLast(1) | KeepEvery(2) | KeepBest(1, "x")
    assert isinstance(combo, AnyOf) and len(combo.policies) == 3 and combo.uses_metrics
    assert not (KeepLast(1) | KeepEvery(2)).uses_metrics
    with pytest.raises(TypeError):
        KeepLast(1) | 3
    for bad in (
        lambda: KeepLast(0),
        lambda: KeepEvery(0),
        lambda: KeepBest(0, "x"),
        lambda: KeepBest(1, ""),
        lambda: KeepBest(1, "x", mode="median"),
        lambda: KeepLast(True),
    ):
        with pytest.raises(ValueError):
            bad()


def test_to_delete_respects_protected():
    records = _records(*((s, {}) for s in range(1, 6)))
    assert to_delete(KeepLast(1), records, protected={2}) == [1, 3, 4]


def test_custom_policy_object(tmp_path):
    class KeepOdd:
        def keep(self, records):
            return {r.step for r in records if r.step % 2}

    root = tmp_path / "run"
    mgr = CheckpointManager(root, retention=KeepOdd() | KeepLast(1))
    for k in range(1, 7):
        mgr.save(k, _state(k))
    assert _dirs(root) == [1, 3, 5, 6]
    with pytest.raises(StateError, match="retention must have keep"):
        CheckpointManager(root, retention=object())
    with pytest.raises(StateError, match="keep_last or retention, not both"):
        CheckpointManager(root, keep_last=1, retention=KeepLast(2))


# ---------------------------------------------------------------- metrics through the manager


def test_keep_best_by_saved_metrics(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, retention=KeepLast(1) | KeepBest(2, "val_loss"))
    losses = {1: 0.9, 2: 0.5, 3: None, 4: 0.5, 5: 0.7, 6: float("nan"), 7: 0.3, 8: None}
    expected_after = {1: [1], 2: [1, 2], 3: [1, 2, 3], 4: [2, 4], 5: [2, 4, 5], 6: [2, 4, 6], 7: [4, 7], 8: [4, 7, 8]}
    for step, loss in losses.items():
        metrics = {"val_loss": loss, "lr": 0.1} if loss is not None else {"lr": 0.1}
        mgr.save(step, _state(step), metrics=metrics)
        assert _dirs(root) == expected_after[step], f"after step {step}"
        if step == 6:
            manifest = json.loads((root / "step_0000000006" / "ckptlib.json").read_text())
            assert manifest["metrics"] == {"val_loss": None, "lr": 0.1}
    result = ckptlib.load(root / "step_0000000007", _state(0))
    assert result.metrics == {"val_loss": 0.3, "lr": 0.1}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_keep_best_alone_never_evicts_the_step_to_resume_from(tmp_path, async_save):
    """A best-only policy whose newest steps are the worst: `latest` (what a resume needs) stays
    (a `best_fn` that evicted the newest steps left a run unresumable elsewhere). Async: each
    save's retention runs in the background after its commit, and the save in flight is
    never a candidate."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, retention=KeepBest(1, "loss"), async_save=async_save)
    for step, loss in enumerate([0.5, 0.9, 1.3, 0.2, 2.0], start=1):
        mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.wait()
        best = 4 if step >= 4 else 1
        assert _dirs(root) == sorted({best, step}), f"after step {step}"
    mgr.close()
    got = _state(0)
    assert CheckpointManager(root).load(got) == 5 and torch.equal(got["w"], torch.full((4,), 5.0))


def test_maybe_save_metrics_reach_the_manifest(tmp_path):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, retention=KeepBest(1, "acc", mode="max"), save_policy=ckptlib.EveryNSteps(2))
    for step, acc in enumerate([0.1, 0.2, 0.8, 0.5, 0.6, 0.9, 0.95], start=1):
        mgr.maybe_save(step, _state(step), metrics={"acc": torch.tensor(acc)})
    # saved: 2 (0.2), 4 (0.5), 6 (0.9); best by acc: 6, which is also latest
    assert _dirs(root) == [6]
    assert json.loads((root / "step_0000000006" / "ckptlib.json").read_text())["metrics"] == {"acc": pytest.approx(0.9)}


@pytest.mark.parametrize(
    "metrics, message",
    [
        ([1.0], "metrics must be a dict of names to numbers, got list"),
        ({"loss": "low"}, "metric 'loss' must be a number, got str 'low'"),
        ({"": 1.0}, "metric name '' must be a non-empty string"),
        ({"loss": torch.ones(2)}, "metric 'loss' must be a number, got Tensor"),
    ],
)
def test_bad_metrics_are_refused_before_anything_is_written(tmp_path, metrics, message):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, _state(1))
    with pytest.raises(StateError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        mgr.save(2, _state(2), metrics=metrics)
    assert _dirs(root) == [1] and mgr.latest() == 1


# ---------------------------------------------------------------- rollback


def test_rollback_keeps_latest_and_replaces_abandoned_steps(tmp_path):
    """KeepLast(1) | KeepEvery(3), steps 1..6 saved; the run rolls back to step 3 and saves
    4, 5, 6, 7 again. A committed step that `latest` does not name is replaced (with a
    StalePointerWarning); `latest` always names the newest save and is never deleted, even
    while higher abandoned steps are the "last" ones."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, retention=KeepLast(1) | KeepEvery(3))
    for k in range(1, 7):
        mgr.save(k, _state(k))
    assert _dirs(root) == [3, 6]
    resumed = CheckpointManager(root, retention=KeepLast(1) | KeepEvery(3))
    state = _state(0)
    assert resumed.load(state, 3) == 3 and state["step"] == 3
    expected = {4: [3, 4, 6], 5: [3, 5, 6], 6: [3, 6], 7: [3, 6, 7]}
    for k, dirs in expected.items():
        if k == 6:  # the abandoned step 6 is committed: replaced
            with pytest.warns(
                StalePointerWarning, match="step_0000000006 is committed but latest names 'step_0000000005'"
            ):
                resumed.save(k, _state(100 + k))
        else:
            resumed.save(k, _state(100 + k))
        assert _dirs(root) == dirs, f"after saving step {k}"
        assert resumed.latest() == k
        got = _state(0)
        assert resumed.load(got) == k and torch.equal(got["w"], torch.full((4,), 100.0 + k))
    with pytest.raises(ckptlib.CheckpointExistsError):
        resumed.save(7, _state(0))  # the step latest names is never overwritten


def test_rollback_latest_older_than_newest_survives_gc(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for k in range(1, 6):
        mgr.save(k, _state(k))
    root_latest = root / "latest"
    os.remove(root_latest)
    os.symlink("step_0000000002", root_latest)  # rolled back: latest names step 2 of 5
    assert cli.main(["gc", str(root), "--keep-last", "1"]) == 0
    assert _dirs(root) == [2, 5]
    assert os.readlink(root_latest) == "step_0000000002" and mgr.latest() == 2
    got = _state(0)
    assert mgr.load(got) == 2 and torch.equal(got["w"], torch.full((4,), 2.0))
    capsys.readouterr()


def test_save_of_the_step_latest_names_is_refused_unless_overwrite(tmp_path):
    mgr = CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(4, _state(4))
    with pytest.raises(ckptlib.CheckpointExistsError, match="step_0000000004 already holds a committed checkpoint"):
        mgr.save(4, _state(5))
    got = _state(0)
    assert mgr.load(got) == 4 and torch.equal(got["w"], torch.full((4,), 4.0))
    mgr.save(4, _state(44), overwrite=True)
    assert _dirs(tmp_path / "run") == [4] and mgr.latest() == 4
    got = _state(0)
    assert mgr.load(got) == 4 and torch.equal(got["w"], torch.full((4,), 44.0)) and got["step"] == 44


# ---------------------------------------------------------------- ckpt gc


def _metric_root(root) -> None:
    mgr = CheckpointManager(root)
    losses = [0.9, 0.4, 0.8, 0.4, 0.6, None, 0.7, 0.65]
    for step, loss in enumerate(losses, start=1):
        mgr.save(step * 10, _state(step), metrics={} if loss is None else {"loss": loss, "acc": 1 - loss})


@pytest.mark.parametrize(
    "flags, kept",
    [
        (["--keep", "2"], [70, 80]),
        (["--keep-last", "3"], [60, 70, 80]),
        (["--keep-every", "40"], [40, 80]),
        (["--keep-best", "2:loss"], [20, 40, 80]),
        (["--keep-best", "1:acc:max"], [40, 80]),
        (["--keep-best", "1:loss:min", "--keep-best", "1:loss:max"], [10, 40, 80]),
        (["--keep-last", "1", "--keep-every", "30", "--keep-best", "2:loss:min"], [20, 30, 40, 60, 80]),
        (["--keep-best", "3:missing"], [80]),
    ],
    ids=[
        "keep2",
        "last3",
        "every40",
        "best2-loss",
        "best1-acc-max",
        "best-min+max",
        "last1+every30+best2",
        "absent-metric",
    ],
)
def test_gc_rules(tmp_path, capsys, flags, kept):
    root = tmp_path / "run"
    _metric_root(root)
    capsys.readouterr()
    assert cli.main(["gc", str(root), *flags, "--dry-run"]) == 0
    assert _dirs(root) == [10, 20, 30, 40, 50, 60, 70, 80]
    dry = capsys.readouterr().out
    assert cli.main(["gc", str(root), *flags]) == 0
    out = capsys.readouterr().out
    removed = sorted(set(range(10, 90, 10)) - set(kept))
    assert _dirs(root) == kept
    assert out.splitlines()[:-1] == [f"removed {root}/step_{s:010d}" for s in removed]
    assert dry.splitlines()[:-1] == [f"would remove {root}/step_{s:010d}" for s in removed]


# ---------------------------------------------------------------- S3


@pytest.mark.s3
def test_s3_retention_combined_policies(s3_root):
    mgr = CheckpointManager(s3_root, retention=KeepLast(1) | KeepBest(1, "loss") | KeepEvery(4))
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 5.0, 5: 1.0, 6: None}
    expected_after = {1: [1], 2: [2], 3: [2, 3], 4: [2, 4], 5: [4, 5], 6: [4, 5, 6]}
    for step, loss in losses.items():
        mgr.save(step, _state(step), metrics=None if loss is None else {"loss": loss})
        assert mgr.steps() == expected_after[step], f"after step {step}"
    names = {key.split("/")[0] for key in mgr.storage.list()}
    assert names == {"latest", "step_0000000004", "step_0000000005", "step_0000000006"}
    assert mgr.storage.read_pointer("latest") == "step_0000000006"
    assert cli.main(["gc", s3_root, "--keep-best", "1:loss"]) == 0
    assert mgr.steps() == [5, 6]  # 6: latest
    got = _state(0)
    assert mgr.load(got) == 6 and torch.equal(got["w"], torch.full((4,), 6.0))


@pytest.mark.s3
@pytest.mark.parametrize("n", [1, 3])
def test_s3_keep_last_after_every_save(s3_root, n):
    mgr = CheckpointManager(s3_root, keep_last=n)
    for k in range(1, 6):
        mgr.save(k, _state(k))
        assert mgr.steps() == list(range(max(1, k - n + 1), k + 1))


def _save_with_rank_metrics(root: str) -> list[int]:
    import torch.distributed as dist

    rank = dist.get_rank()
    mgr = CheckpointManager(root, retention=KeepBest(2, "loss"))
    rank0_losses = [0.5, 0.1, 0.9, 0.3]
    for step, loss in enumerate(rank0_losses, start=1):
        # each rank passes its own value; the manifest records rank 0's
        mgr.save(step, {"w": torch.full((2,), float(step))}, metrics={"loss": loss if rank == 0 else 100.0 - loss})
    return mgr.steps()


def test_keep_best_uses_rank0s_metrics_on_every_rank(tmp_path, dist_run):
    root = str(tmp_path / "run")
    assert dist_run(2, _save_with_rank_metrics, root) == [[2, 4], [2, 4]]
    for step, loss in ((2, 0.1), (4, 0.3)):
        doc = json.loads(open(os.path.join(root, f"step_{step:010d}", "ckptlib.json")).read())
        assert doc["metrics"] == {"loss": loss}


class _KeepLowestLoss:
    """A user's policy without `uses_metrics`: it reads the metrics, so the manager must load them."""

    def keep(self, records):
        scored = [r for r in records if isinstance(r.metrics.get("loss"), float)]
        return {min(scored, key=lambda r: r.metrics["loss"]).step} if scored else set()


@pytest.mark.parametrize("combined", [False, True], ids=["alone", "with-keep-last"])
def test_a_custom_policy_without_uses_metrics_gets_the_saved_metrics(tmp_path, combined):
    root = tmp_path / "run"
    policy = _KeepLowestLoss() | KeepLast(1) if combined else _KeepLowestLoss()
    mgr = CheckpointManager(root, retention=policy)
    for step, loss in [(1, 0.7), (2, 0.2), (3, 0.9), (4, 0.5)]:
        mgr.save(step, _state(step), metrics={"loss": loss})
    assert _dirs(root) == [2, 4]  # the lowest loss, and latest (never deleted)


def test_a_step_with_a_damaged_manifest_has_no_metrics_for_keep_best(tmp_path):
    """A manifest that is not valid JSON does not stop retention: that step has no value."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, retention=KeepBest(1, "loss"))
    mgr.save(1, _state(1), metrics={"loss": 0.1})
    (root / "step_0000000001" / "ckptlib.json").write_text("{not json")
    mgr.save(2, _state(2), metrics={"loss": 0.5})
    assert _dirs(root) == [2]  # step 1 has no usable value: KeepBest never keeps it
    mgr.save(3, _state(3), metrics={"loss": 0.3})
    assert _dirs(root) == [3]


def test_a_step_deleted_while_a_dry_run_reads_its_metrics_has_none(tmp_path, monkeypatch):
    """gc(dry_run=True) takes no lock: a writer's retention may delete a step between the dry
    run's listing and its read of that step's manifest. The step then has no value, no error."""
    import shutil

    from ckptlib.storage.local import LocalStorage

    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    for step, loss in [(1, 0.1), (2, 0.5), (3, 0.3)]:
        mgr.save(step, _state(step), metrics={"loss": loss})
    pruner = CheckpointManager(root, retention=KeepBest(1, "loss"))
    real_read_pointer = LocalStorage.read_pointer

    def read_pointer_then_lose_step_1(self, name):
        if (root / "step_0000000001").exists():  # the other writer's retention, after the dry run listed the steps
            shutil.rmtree(root / "step_0000000001")
        return real_read_pointer(self, name)

    monkeypatch.setattr(LocalStorage, "read_pointer", read_pointer_then_lose_step_1)
    assert pruner.gc(dry_run=True) == ["step_0000000001", "step_0000000002"]


# ---------------------------------------------------------------- the cluster tier's gc


def _tier_dirs(uri: str) -> list[int]:
    from ckptlib.storage import open_storage

    return sorted(int(n[5:]) for n in open_storage(uri).list_children() if n.startswith("step_"))


_TIER_GC_CASES = [
    pytest.param(
        kind,
        keep,
        remote_keep,
        rollback,
        id=f"{kind}-keep_last{keep}-remote_{remote_keep or 'all'}-{how}",
        marks=[pytest.mark.s3] if kind == "s3" else [],
    )
    for kind in ("local", "s3")
    for keep in (1, 2)
    for remote_keep in (None, 1)
    for rollback, how in ((False, "plain"), (True, "after_rollback"))
    if kind == "local" or (keep, remote_keep, rollback) in ((1, 1, False), (2, None, True))
]


@pytest.mark.parametrize(("kind", "keep", "remote_keep", "rollback"), _TIER_GC_CASES)
def test_tier_gc_reports_every_deletion_and_its_dry_run_what_it_deletes(
    request, tmp_path, kind, keep, remote_keep, rollback
):
    """The cluster tier's gc: the node root's and the remote's deletions are all returned, with
    where they are, and the dry run returns exactly what the run then deletes."""
    tier_remote = str(tmp_path / "remote") if kind == "local" else request.getfixturevalue("s3_root")
    local = str(tmp_path / "local")
    writer = CheckpointManager(local, cluster=ckptlib.Cluster(remote=tier_remote))
    for step in (1, 2, 3, 4):
        writer.save(step, _state(step))
    writer.wait()
    writer.close()
    pruner = CheckpointManager(
        local, keep_last=keep, cluster=ckptlib.Cluster(remote=ckptlib.RemoteTier(tier_remote, keep_last=remote_keep))
    )
    if rollback:  # the step resumed is kept, as after a save (the next save's parent)
        assert pruner.load({"w": torch.zeros(4), "step": -1}, step=2) == 2
    local_gone = {1: [1, 2, 3], 2: [1, 2]}[keep]
    remote_gone = [] if remote_keep is None else [1, 2, 3]
    if rollback:
        local_gone = [s for s in local_gone if s != 2]  # the remote's retention is its own
    want = [f"{tier_remote.rstrip('/')}/step_{s:010d}" for s in remote_gone] + [
        f"node0:{local}/step_{s:010d}" for s in local_gone
    ]
    before_local, before_remote = _tier_dirs(local), _tier_dirs(tier_remote)
    assert pruner.gc(dry_run=True) == want
    assert (_tier_dirs(local), _tier_dirs(tier_remote)) == (before_local, before_remote)  # nothing deleted
    assert pruner.gc() == want
    assert _tier_dirs(local) == [s for s in before_local if s not in local_gone]
    assert _tier_dirs(tier_remote) == [s for s in before_remote if s not in remote_gone]
    assert not pruner.remote.known_steps & set(remote_gone)  # a later save of one is no "replacement"
    assert pruner.gc(dry_run=True) == [] and pruner.gc() == []
    pruner.close()
