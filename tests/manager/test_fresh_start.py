"""Nothing to resume is said, never silent (issues 33 and 37):

- a manager root that does not exist, or an empty one beside other runs' roots (a typo in the
  path), is a FreshStartWarning naming it; `load(require=True)` makes any fresh start a
  CheckpointNotFoundError, on every rank;
- the cluster tier on a fresh node (no local step anywhere) whose remote does not answer cannot
  know there is nothing to resume: RemoteUnavailableError naming the remote, on every rank,
  unless `fresh_start_ok=True`; the remote's committed step is then still there to resume."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers.manager import step_state as _state
from helpers.storage import local_remote_down

import ckptlib
from ckptlib import (
    CheckpointManager,
    CheckpointNotFoundError,
    Cluster,
    FreshStartWarning,
    RemoteUnavailableError,
    RemoteUnavailableWarning,
    StorageError,
)
from ckptlib.storage import open_storage


def _fresh() -> dict:
    return {"model": {"w": torch.zeros(64, 33), "b": torch.zeros(7)}, "step": -1}


def _no_warnings_load(mgr, state, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return mgr.load(state, **kwargs)


# ---------------------------------------------------------------- a single root
def test_a_root_that_does_not_exist_warns_with_its_path(tmp_path):
    root = str(tmp_path / "runs" / "AA")
    with pytest.warns(FreshStartWarning) as record:
        assert CheckpointManager(root).load(_fresh()) is None
    assert [str(w.message) for w in record if w.category is FreshStartWarning] == [
        f"{root}: nothing to resume (it does not exist); training starts from scratch. "
        "Is the root's path right? load(require=True) makes this an error"
    ]


def test_an_empty_root_beside_other_runs_names_them(tmp_path):
    for run in ("A", "B"):
        CheckpointManager(str(tmp_path / run)).save(1, _state(1))
    (tmp_path / "notes").mkdir()  # a directory that is no manager root is not named
    (tmp_path / "AA").mkdir()
    with pytest.warns(
        FreshStartWarning,
        match=r"AA: nothing to resume \(it is empty, while its parent holds other "
        r"runs' roots \(A, B\)\)",
    ):
        assert CheckpointManager(str(tmp_path / "AA")).load(_fresh()) is None


@pytest.mark.parametrize("layout", ["empty-alone", "debris-only"])
def test_a_fresh_root_that_looks_deliberate_is_quiet(tmp_path, layout):
    root = tmp_path / "run"
    root.mkdir()
    if layout == "debris-only":  # a save killed before its first commit
        (root / "step_0000000001").mkdir()
        (root / "step_0000000001" / "__0_0.distcp").write_bytes(b"x")
    assert _no_warnings_load(CheckpointManager(str(root)), _fresh()) is None


@pytest.mark.parametrize("layout", ["missing", "empty", "debris-only"])
def test_require_makes_any_fresh_start_an_error(tmp_path, layout):
    root = tmp_path / "run"
    reason = {"missing": "it does not exist", "empty": "it is empty", "debris-only": "it holds no committed step"}
    if layout != "missing":
        root.mkdir()
    if layout == "debris-only":
        (root / "step_0000000001").mkdir()
        (root / "step_0000000001" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError) as info:
        CheckpointManager(str(root)).load(_fresh(), require=True)
    assert str(info.value) == (
        f"{root}: nothing to resume ({reason[layout]}); load(require=True) needs a committed step there"
    )
    assert info.value.path == str(root)


def test_require_with_a_committed_step_loads_it(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    mgr.save(3, _state(3))
    state = _fresh()
    assert _no_warnings_load(mgr, state, require=True) == 3
    assert torch.equal(state["model"]["w"], _state(3)["model"]["w"])


def _require_on_every_rank(root: str) -> str:
    try:
        CheckpointManager(root).load(_fresh(), require=True)
    except CheckpointNotFoundError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_require_fails_on_every_rank(tmp_path, dist_run):
    root = str(tmp_path / "missing")
    want = f"CheckpointNotFoundError: {root}: nothing to resume (it does not exist); "
    want += "load(require=True) needs a committed step there"
    assert dist_run(2, _require_on_every_rank, root) == [want, want]


# ---------------------------------------------------------------- the cluster tier, remote down
@pytest.fixture
def remote_down(tmp_path, monkeypatch):
    """(remote URI, take_down(), bring_up()): a directory remote whose storage calls fail once down."""
    uri = str(tmp_path / "remote")
    return (uri, *local_remote_down(monkeypatch, uri))


def test_a_fresh_node_with_the_remote_down_refuses_to_start_from_scratch(tmp_path, remote_down):
    remote, take_down, bring_up = remote_down
    trained = CheckpointManager(str(tmp_path / "old-node"), cluster=Cluster(remote=remote))
    trained.save(7, _state(7))
    assert trained.wait().step == 7
    trained.close()

    take_down()
    replacement = CheckpointManager(str(tmp_path / "new-node"), cluster=Cluster(remote=remote))
    with pytest.raises(RemoteUnavailableError) as info:
        replacement.load(_fresh())
    assert str(info.value) == (
        f"{remote}: cannot read the remote root (StorageError: {remote}: injected: connection refused) and no node "
        "holds a local step: whether a step was committed there is unknown, and resuming nothing could retrain "
        "it and then overwrite it. Retry once the remote answers, or load(..., fresh_start_ok=True) to start "
        "from scratch"
    )
    assert info.value.path == remote and isinstance(info.value, StorageError)

    bring_up()  # the remote answers again: the trained step is there and resumes
    state = _fresh()
    assert replacement.load(state) == 7
    assert torch.equal(state["model"]["w"], _state(7)["model"]["w"])
    assert open_storage(remote).read_pointer("latest") == "step_0000000007"
    replacement.close()


def test_fresh_start_ok_starts_from_scratch_with_the_remote_down(tmp_path, remote_down):
    remote, take_down, _ = remote_down
    os.makedirs(remote)
    take_down()
    mgr = CheckpointManager(str(tmp_path / "node"), cluster=Cluster(remote=remote))
    with pytest.warns(RemoteUnavailableWarning, match="cannot read the remote root .*; using the local tiers only"):
        assert mgr.load(_fresh(), fresh_start_ok=True) is None
    mgr.close()


def test_a_reachable_empty_remote_is_a_plain_fresh_start(tmp_path):
    remote = str(tmp_path / "remote")
    os.makedirs(remote)
    mgr = CheckpointManager(str(tmp_path / "node"), cluster=Cluster(remote=remote))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FreshStartWarning)  # the node root does not exist yet
        warnings.simplefilter("error", RemoteUnavailableWarning)
        assert mgr.load(_fresh()) is None
    mgr.close()


def _fresh_node_remote_down(base: str, remote: str) -> str:
    import ckptlib.storage.local as local_storage

    real = local_storage.LocalStorage.list

    def failing(self, *args, **kwargs):
        if self.uri.startswith(remote):
            raise StorageError(f"{self.uri}: injected: connection refused")
        return real(self, *args, **kwargs)

    local_storage.LocalStorage.list = failing
    local_storage.LocalStorage.read_pointer = lambda self, name: failing(self)
    node = int(os.environ["GROUP_RANK"])
    mgr = CheckpointManager(os.path.join(base, f"node{node}"), cluster=Cluster(remote=remote))
    try:
        mgr.load(_fresh())
    except RemoteUnavailableError as exc:
        return type(exc).__name__
    finally:
        mgr.close()
    return "loaded"


def test_the_refusal_is_on_every_rank_of_every_node(tmp_path, dist_run):
    remote = str(tmp_path / "remote")
    os.makedirs(remote)
    ckptlib.save(os.path.join(remote, "step_0000000001"), _state(1), step=1)
    results = dist_run(4, _fresh_node_remote_down, str(tmp_path), remote, nodes=2)
    assert results == ["RemoteUnavailableError"] * 4


def _warnings_on_this_rank(root: str, action: str) -> list[str]:
    import torch.distributed as dist

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = CheckpointManager(root)
        if action == "fresh":
            mgr.load(_fresh())
        else:  # a latest that names an uncommitted step: every rank resolves it alike
            mgr.latest()
        mgr.close()
    dist.barrier()
    said = (FreshStartWarning, ckptlib.StalePointerWarning)
    return [f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, said)]


@pytest.mark.parametrize("action", ["fresh", "stale-latest"])
def test_a_warning_every_rank_would_give_is_given_once_per_job(tmp_path, dist_run, action):
    """Decided on rank 0, said by rank 0 alone: 4 ranks print one FreshStartWarning (or one
    StalePointerWarning), not four."""
    root = str(tmp_path / "runs" / "AA")
    if action == "stale-latest":
        CheckpointManager(root).save(3, _state(3))
        os.symlink("step_0000000009", os.path.join(root, "latest.tmp"))
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    results = dist_run(4, _warnings_on_this_rank, root, action)
    if action == "fresh":
        want = (
            f"FreshStartWarning: {root}: nothing to resume (it does not exist); training starts from scratch. "
            "Is the root's path right? load(require=True) makes this an error"
        )
    else:
        want = (
            f"StalePointerWarning: {root}/latest points to 'step_0000000009', which is not a committed checkpoint; "
            "using step 3"
        )
    assert results == [[want], [], [], []]
