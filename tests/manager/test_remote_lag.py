"""Training survives the remote (issue 37, item 1): with the remote unreachable a save whose
local commit succeeded never fails; the step stays local (RemoteUnavailableWarning naming the
steps not uploaded, `mgr.remote_lag`), later saves try again with a backoff and upload the
newest step once the remote answers; `RemoteLag(steps=N)` / `RemoteLag(seconds=S)` make a lag
past the limit a RemoteLagError. A directory remote whose storage calls fail, and S3 behind a
fault proxy."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.manager import step_state as _state
from helpers.storage import local_remote_down, remote_that_goes_down

from ckptlib import Cluster, RemoteLag, RemoteLagError, RemoteLagReport, RemoteUnavailableWarning, StateError
from ckptlib.loading.loading import load
from ckptlib.manager.manager import CheckpointManager
from ckptlib.storage import open_storage


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def remote_down(request, tmp_path, monkeypatch):
    """(remote URI, take_down(), bring_up())."""
    return remote_that_goes_down(request, tmp_path, monkeypatch, request.param)


def _remote_holds(uri: str, step: int) -> bool:
    want = _state(step)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": -1}
    load(f"{uri.rstrip('/')}/step_{step:010d}", got)
    return got["step"] == step and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())


def test_an_unreachable_remote_never_stops_training_and_the_newest_step_is_uploaded_later(tmp_path, remote_down):
    uri, take_down, bring_up = remote_down
    mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=RemoteLag(retry_after=0)))
    assert mgr.remote_lag == RemoteLagReport()
    mgr.save(1, _state(1))
    assert mgr.wait().step == 1
    take_down()
    mgr.save(2, _state(2))
    with pytest.warns(RemoteUnavailableWarning) as caught:
        assert mgr.wait() is None  # nothing reached the remote; nothing raised
    text = str(caught[0].message)
    assert text.startswith(f"{uri}: step 2 could not be uploaded; it stays local and committed"), text
    assert f"1 step(s) not uploaded yet (2); last failure: {uri}: cannot lock the remote root: " in text, text
    with pytest.warns(RemoteUnavailableWarning, match=re.escape("2 step(s) not uploaded yet (2, 3)")):
        mgr.save(3, _state(3))  # the previous save's warning is given here, at the latest
        mgr.wait()
    lag = mgr.remote_lag
    assert lag.steps == (2, 3) and lag.seconds > 0 and lag.error.startswith(f"{uri}: cannot lock the remote root"), lag
    assert mgr.local_steps() == [1, 2, 3]

    bring_up()
    assert open_storage(uri).read_pointer("latest") == "step_0000000001"  # never a step it lacks
    mgr.save(4, _state(4))
    assert mgr.wait().step == 4  # the newest step, uploaded: the remote caught up
    assert mgr.remote_lag == RemoteLagReport()
    assert open_storage(uri).read_pointer("latest") == "step_0000000004"
    assert _remote_holds(uri, 4)
    mgr.close()


def test_after_a_failure_saves_within_the_backoff_do_not_try_the_remote(tmp_path):
    uri = str(tmp_path / "remote")
    with pytest.MonkeyPatch.context() as patch:
        take_down, bring_up = local_remote_down(patch, uri)
        mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=RemoteLag()))
        mgr.save(1, _state(1))
        mgr.wait()
        take_down()
        mgr.save(2, _state(2))
        with pytest.warns(RemoteUnavailableWarning, match="step 2 could not be uploaded"):
            mgr.wait()
        bring_up()
        mgr.save(3, _state(3))  # within the first 30 s of backoff: not tried, even though it is up again
        with pytest.warns(RemoteUnavailableWarning, match=r"step 3 is not uploaded \(the remote failed recently\)"):
            assert mgr.wait() is None
        assert mgr.remote_lag.steps == (2, 3)
        assert open_storage(uri).read_pointer("latest") == "step_0000000001"
        mgr.close()


@pytest.mark.parametrize("limit", [0, 1], ids=["steps0", "steps1"])
def test_a_save_whose_skip_would_pass_the_limit_tries_the_remote_within_the_backoff(tmp_path, limit):
    uri = str(tmp_path / "remote")
    with pytest.MonkeyPatch.context() as patch:
        take_down, bring_up = local_remote_down(patch, uri)
        lag = RemoteLag(steps=limit)  # the default 30 s backoff
        mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=lag))
        take_down()
        mgr.save(1, _state(1))
        if limit == 0:
            with pytest.raises(RemoteLagError, match=re.escape("1 steps not uploaded, more than RemoteLag(steps=0)")):
                mgr.wait()
        else:
            with pytest.warns(RemoteUnavailableWarning, match="step 1 could not be uploaded"):
                mgr.wait()
        assert mgr.remote_lag.steps == (1,)
        bring_up()
        mgr.save(2, _state(2))  # within the backoff, but leaving it untried would pass the limit
        assert mgr.wait().step == 2
        assert mgr.remote_lag == RemoteLagReport()
        assert open_storage(uri).read_pointer("latest") == "step_0000000002"
        assert _remote_holds(uri, 2)
        mgr.close()


@pytest.mark.parametrize("limit", [0, 1], ids=["steps0", "steps1"])
def test_a_lag_past_the_limit_is_a_remote_lag_error(tmp_path, limit):
    uri = str(tmp_path / "remote")
    with pytest.MonkeyPatch.context() as patch:
        take_down, _ = local_remote_down(patch, uri)
        lag = RemoteLag(steps=limit, retry_after=0)
        mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=lag))
        mgr.save(1, _state(1))
        mgr.wait()
        take_down()
        for step in range(2, 2 + limit):  # within the limit: warned
            mgr.save(step, _state(step))
            with pytest.warns(RemoteUnavailableWarning):
                mgr.wait()
        last = 2 + limit
        mgr.save(last, _state(last))  # the local save itself succeeds
        with pytest.raises(RemoteLagError) as info:
            mgr.wait()
        steps = ", ".join(str(s) for s in range(2, last + 1))
        assert str(info.value).startswith(
            f"{uri}: {limit + 1} steps not uploaded, more than RemoteLag(steps={limit}) allows (steps {steps}; "
            "last failure: "
        ), str(info.value)
        assert info.value.path == uri
        assert mgr.local_steps() == list(range(1, last + 1))  # every step committed locally
        mgr.close()


def test_a_time_limit_counts_from_the_oldest_step_not_uploaded(tmp_path):
    uri = str(tmp_path / "remote")
    with pytest.MonkeyPatch.context() as patch:
        take_down, _ = local_remote_down(patch, uri)
        lag = RemoteLag(seconds=0, retry_after=0)
        mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=lag))
        take_down()
        mgr.save(1, _state(1))
        with pytest.raises(RemoteLagError, match=r"the oldest step not uploaded was saved \d+ s ago, more than "):
            mgr.wait()
        mgr.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": -1}, "RemoteLag(steps=) must be a non-negative int or None, got -1"),
        ({"steps": 1.5}, "RemoteLag(steps=) must be a non-negative int or None, got 1.5"),
        ({"seconds": -3}, "RemoteLag(seconds=) must be a non-negative number, got -3"),
        ({"retry_after": None}, "RemoteLag(retry_after=) must be a non-negative number, got None"),
        ({"steps": True}, "RemoteLag(steps=) must be a non-negative int or None, got True"),
        ({"seconds": False}, "RemoteLag(seconds=) must be a non-negative number, got False"),
        ({"retry_after": -0.5}, "RemoteLag(retry_after=) must be a non-negative number, got -0.5"),
        ({"seconds": float("nan")}, "RemoteLag(seconds=) must be a non-negative number, got nan"),
    ],
    ids=["steps-1", "steps-float", "seconds-3", "retry-None", "steps-bool", "seconds-bool", "retry-neg", "seconds-nan"],
)
def test_remote_lag_refuses_bad_values(kwargs, message):
    with pytest.raises(StateError, match=re.escape(message)):
        RemoteLag(**kwargs)
    with pytest.raises(StateError, match="remote_lag must be a RemoteLag, got int 3"):
        Cluster(remote="/tmp/x", remote_lag=3)
