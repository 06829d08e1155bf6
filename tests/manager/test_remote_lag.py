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
        assert mgr.wait() is None  # the wait is not over: wait() does not try either
        mgr.close()  # the end of the job: no later save will come, so close() uploads 3
        assert open_storage(uri).read_pointer("latest") == "step_0000000003"
        assert _remote_holds(uri, 3)
        assert mgr.remote_lag == RemoteLagReport()


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
        with pytest.raises(RemoteLagError, match=rf"step {last} is committed locally only: its upload at close\(\)"):
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
        with pytest.raises(RemoteLagError, match=r"step 1 is committed locally only: its upload at close\(\)"):
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


class _Clock:
    """Stands in for `time` in remote_lag: monotonic() is `now`, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_close_uploads_the_newest_step_skipped_within_the_retry_wait(tmp_path, remote_down):
    uri, take_down, bring_up = remote_down
    mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=RemoteLag()))
    mgr.save(1, _state(1))
    assert mgr.wait().step == 1
    take_down()  # a short outage
    mgr.save(2, _state(2))
    with pytest.warns(RemoteUnavailableWarning, match="step 2 could not be uploaded"):
        assert mgr.wait() is None
    bring_up()  # the remote answers again, but the last saves fall inside the retry wait
    for step in (3, 4):
        mgr.save(step, _state(step))
        with pytest.warns(
            RemoteUnavailableWarning,
            match=rf"step {step} is not uploaded \(the remote failed recently\); .* later "
            r"save, wait\(\) or close\(\)",
        ):
            assert mgr.wait() is None
    assert mgr.remote_lag.steps == (2, 3, 4)
    assert open_storage(uri).read_pointer("latest") == "step_0000000001"
    mgr.close()  # the end of the job: the newest step reaches the remote
    assert open_storage(uri).read_pointer("latest") == "step_0000000004"
    assert _remote_holds(uri, 4)
    assert sorted(open_storage(uri).list_children()) == ["step_0000000001", "step_0000000004"]
    assert mgr.remote_lag == RemoteLagReport()


def test_close_with_the_remote_still_down_raises_naming_the_step_and_a_resume_uploads_it(tmp_path, remote_down):
    uri, take_down, bring_up = remote_down
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=uri, remote_lag=RemoteLag()))
    mgr.save(1, _state(1))
    mgr.wait()
    take_down()
    mgr.save(2, _state(2))
    with pytest.warns(RemoteUnavailableWarning, match="step 2 could not be uploaded"):
        mgr.wait()
    mgr.save(3, _state(3))  # inside the retry wait: skipped
    with pytest.warns(RemoteUnavailableWarning, match="step 3 is not uploaded"):
        with pytest.raises(RemoteLagError) as info:
            mgr.close()
    text = str(info.value)
    assert text.startswith(
        f"{uri}: step 3 is committed locally only: its upload at close() failed and no later save will try again "
        f"(2 step(s) not uploaded: 2, 3; last failure: "
    ), text
    assert text.endswith("; a job that resumes from the local roots uploads it"), text
    assert info.value.path == uri
    assert mgr.local_steps() == [1, 2, 3]  # nothing committed is lost
    bring_up()
    assert open_storage(uri).read_pointer("latest") == "step_0000000001"
    restarted = CheckpointManager(local, cluster=Cluster(remote=uri))  # close() released the locks
    state = {"model": {k: torch.zeros_like(v) for k, v in _state(3)["model"].items()}, "step": -1}
    assert restarted.load(state) == 3
    assert restarted.wait().step == 3  # the resumed step the remote lacks is uploaded
    assert open_storage(uri).read_pointer("latest") == "step_0000000003"
    assert _remote_holds(uri, 3)
    restarted.close()


def test_wait_uploads_a_skipped_step_once_the_retry_wait_is_over(tmp_path, monkeypatch):
    import ckptlib.manager.cluster.remote_lag as remote_lag

    clock = _Clock()
    monkeypatch.setattr(remote_lag, "time", clock)
    uri = str(tmp_path / "remote")
    take_down, bring_up = local_remote_down(monkeypatch, uri)
    mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=RemoteLag(retry_after=30)))
    take_down()
    mgr.save(1, _state(1))
    with pytest.warns(RemoteUnavailableWarning, match="step 1 could not be uploaded"):
        mgr.wait()
    bring_up()
    clock.now += 29
    mgr.save(2, _state(2))
    with pytest.warns(RemoteUnavailableWarning, match="step 2 is not uploaded"):
        assert mgr.wait() is None  # 29 s into the 30 s wait: not tried
    assert open_storage(uri).read_pointer("latest") is None
    clock.now += 1
    result = mgr.wait()  # the wait is over: wait() sends what the next save would have
    assert result is not None and result.step == 2
    assert open_storage(uri).read_pointer("latest") == "step_0000000002"
    assert _remote_holds(uri, 2)
    assert mgr.remote_lag == RemoteLagReport()
    assert mgr.wait() is None
    mgr.close()


@pytest.mark.parametrize("ending", ["clean", "error"])
def test_a_with_block_ends_like_close_unless_an_error_ends_it(tmp_path, monkeypatch, ending):
    """Leaving `with CheckpointManager(...)` normally is close(): the step the remote lacks is
    a RemoteLagError; leaving it with an error propagates that error, with no upload tried."""
    uri = str(tmp_path / "remote")
    take_down, _ = local_remote_down(monkeypatch, uri)
    mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri))
    take_down()
    with pytest.warns(RemoteUnavailableWarning, match="step 1 could not be uploaded"):
        mgr.save(1, _state(1))
        mgr.wait()
    expected = RemoteLagError if ending == "clean" else KeyError
    with pytest.raises(expected) as info:
        with mgr:
            if ending == "error":
                raise KeyError("the training loop failed")
    if ending == "clean":
        assert str(info.value).startswith(f"{uri}: step 1 is committed locally only: its upload at close() failed")
    else:
        assert info.value.args == ("the training loop failed",)
    assert mgr.remote_lag.steps == (1,)
    assert mgr.tier.lock.holder() is None  # released either way


@pytest.mark.parametrize("remote_back", [True, False], ids=["remote_back", "remote_still_down"])
def test_a_step_resumed_while_the_remote_is_down_is_uploaded_by_close(tmp_path, remote_down, remote_back):
    """A job that resumes a step the remote lacks while the remote does not answer, and ends
    without saving: close() uploads that step, or raises RemoteLagError naming it."""
    uri, take_down, bring_up = remote_down
    local = str(tmp_path / "local")
    mgr = CheckpointManager(local, cluster=Cluster(remote=uri))
    mgr.save(1, _state(1))
    mgr.wait()
    take_down()
    mgr.save(2, _state(2))
    with pytest.warns(RemoteUnavailableWarning):
        mgr.wait()
    with pytest.raises(RemoteLagError):
        mgr.close()
    restarted = CheckpointManager(local, cluster=Cluster(remote=uri))
    state = {"model": {k: torch.zeros_like(v) for k, v in _state(2)["model"].items()}, "step": -1}
    with pytest.warns(RemoteUnavailableWarning, match="using the local tiers only"):
        assert restarted.load(state) == 2
    assert restarted.wait() is None  # nothing tried against a remote just found down
    assert restarted.remote_lag.steps == (2,)
    assert restarted.remote_lag.error == f"{uri}: unreachable when step 2 was resumed"
    if remote_back:
        bring_up()
        restarted.close()
        assert open_storage(uri).read_pointer("latest") == "step_0000000002"
        assert _remote_holds(uri, 2)
    else:
        with pytest.raises(RemoteLagError, match=r": step 2 is committed locally only: its upload at close\(\) failed"):
            restarted.close()
        bring_up()
        assert open_storage(uri).read_pointer("latest") == "step_0000000001"


def _reads_fail(monkeypatch, uri: str) -> list[int]:
    """LocalStorage.read under `uri` raises StorageError while the returned list is non-empty
    (a remote whose GETs fail while its conditional PUTs answer)."""
    import ckptlib.storage.local as local_storage
    from ckptlib.errors import StorageError

    failing: list[int] = [1]
    real = local_storage.LocalStorage.read

    def read(self, path, *args, **kwargs):
        if failing and self.uri.startswith(uri):
            raise StorageError(f"{self.uri}/{path}: injected: connection reset", path=f"{self.uri}/{path}")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(local_storage.LocalStorage, "read", read)
    return failing


def test_a_remote_lock_that_cannot_be_read_is_the_remote_unavailable_not_another_writer(tmp_path, monkeypatch):
    """Found by the fault model: an upload whose lock attempt finds a lock file (one a failed
    release left) and cannot read it took the failed read for a lock held by an unknown writer,
    an UploadError from the next wait() for good; it is the remote being unreachable."""
    uri = str(tmp_path / "remote")
    mgr = CheckpointManager(str(tmp_path / "local"), cluster=Cluster(remote=uri, remote_lag=RemoteLag(retry_after=0)))
    mgr.save(1, _state(1))
    assert mgr.wait().step == 1
    store = open_storage(uri)
    lock = '{"format": "ckptlib-lock", "host": "gone", "pid": 1, "token": "t", "lease_s": 1, "created": "%s"}'
    store.write("ckptlib.lock", (lock % "2026-01-01T00:00:00+00:00").encode())  # its lease long expired
    failing = _reads_fail(monkeypatch, uri)
    mgr.save(2, _state(2))
    with pytest.warns(RemoteUnavailableWarning) as caught:
        assert mgr.wait() is None
    text = str(caught[0].message)
    assert f"last failure: {uri}: cannot lock the remote root: " in text and "injected: connection reset" in text, text
    assert mgr.remote_lag.steps == (2,)
    failing.clear()  # the remote answers again: the lock is stale (its lease expired), the upload proceeds
    with pytest.warns(UserWarning, match="removing a stale lock left by pid 1 on host gone"):
        mgr.save(3, _state(3))
        assert mgr.wait().step == 3
    assert store.read_pointer("latest") == "step_0000000003" and _remote_holds(uri, 3)
    mgr.close()
