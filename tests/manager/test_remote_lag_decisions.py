"""The remote-lag decisions of `ckptlib.manager.cluster.remote_lag.LagState`, on a clock the
test moves: when an upload is tried again (the backoff: `retry_after` doubling per failure up to
`MAX_BACKOFF`, and never past the limit), when a lag is past `RemoteLag(steps=)` /
`RemoteLag(seconds=)` (both bounds exclusive: exactly the limit is still within it), from which
step the time counts (the oldest not uploaded), which failures count as the remote being
unreachable, and the exact messages. Single process; the end-to-end behaviour is in
tests/manager/test_remote_lag.py."""

from __future__ import annotations

import types

import pytest

from ckptlib.errors import RemoteLagError, StorageError, UploadError, UploadRankLostError
from ckptlib.manager.cluster import remote_lag
from ckptlib.manager.cluster.remote_lag import MAX_BACKOFF, LagState, RemoteLag, describe_steps, tolerated

URI = "s3://bucket/run"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(remote_lag, "time", types.SimpleNamespace(monotonic=lambda: c.now))
    return c


def _unreachable(text: str = "connection refused") -> UploadError:
    err = UploadError(f"{URI}: {text}", path=URI)
    err.unreachable = True
    return err


def test_the_backoff_doubles_from_retry_after_up_to_max_backoff(clock):
    lag = LagState(RemoteLag(retry_after=30))
    waits = []
    for step in range(1, 9):
        lag.left_local(step, _unreachable())
        waits.append(lag.next_try - clock.now)
        clock.now = lag.next_try
    assert MAX_BACKOFF == 600.0
    assert waits == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0, 600.0]
    lag.uploaded()  # a success starts the count again
    assert lag.report() == remote_lag.RemoteLagReport()
    lag.left_local(9, _unreachable())
    assert lag.next_try - clock.now == 30.0


def test_an_upload_is_tried_again_exactly_when_the_backoff_is_over(clock):
    lag = LagState(RemoteLag(retry_after=30))
    assert lag.due(1)  # nothing lags: always tried
    lag.left_local(1, _unreachable())
    start = clock.now
    clock.now = start + 29.5
    assert not lag.due(2)
    clock.now = start + 30.0
    assert lag.due(2)
    lag.left_local(2, _unreachable())  # the second failure: 60 s
    clock.now = start + 30.0 + 59.5
    assert not lag.due(3)
    clock.now = start + 30.0 + 60.0
    assert lag.due(3)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_within_the_backoff_a_save_is_tried_only_when_skipping_it_would_pass_the_steps_limit(clock, limit):
    lag = LagState(RemoteLag(steps=limit, retry_after=1000))
    lag.left_local(1, _unreachable())
    for step in range(2, limit + 1):  # skipping these keeps the lag within the limit
        assert not lag.due(step), (step, lag.steps)
        lag.left_local(step, None)
    assert lag.steps == list(range(1, limit + 1))
    assert not lag.due(limit)  # the same step again adds nothing
    assert lag.due(limit + 1)  # one more left untried would pass the limit


def test_within_the_backoff_a_save_is_tried_once_the_oldest_step_is_past_the_seconds_limit(clock):
    lag = LagState(RemoteLag(seconds=100, retry_after=1000))
    start = clock.now
    lag.left_local(1, _unreachable())
    clock.now = start + 50
    lag.left_local(2, None)
    clock.now = start + 100  # exactly the limit: within it
    assert not lag.due(3)
    clock.now = start + 100.5
    assert lag.due(3)


def test_the_time_counts_from_the_oldest_step_not_uploaded(clock):
    lag = LagState(RemoteLag(seconds=100))
    start = clock.now
    lag.left_local(1, _unreachable("first"))
    clock.now = start + 40
    lag.left_local(2, _unreachable("second"))
    clock.now = start + 70
    report = lag.report()
    assert (report.steps, report.seconds, report.error) == ((1, 2), 70.0, f"{URI}: second")


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_a_steps_lag_is_over_the_limit_only_past_it(clock, limit):
    lag = LagState(RemoteLag(steps=limit))
    for step in range(1, limit + 1):
        lag.left_local(step * 10, _unreachable())
    assert lag.over(URI) is None  # exactly `limit` steps not uploaded: allowed
    lag.left_local(999, _unreachable("gone"))
    steps = ", ".join(str(s) for s in [*(s * 10 for s in range(1, limit + 1)), 999])
    assert lag.over(URI) == (
        f"{URI}: {limit + 1} steps not uploaded, more than RemoteLag(steps={limit}) allows "
        f"(steps {steps}; last failure: {URI}: gone)"
    )


def test_a_seconds_lag_is_over_the_limit_only_past_it(clock):
    lag = LagState(RemoteLag(seconds=10))
    start = clock.now
    assert lag.over(URI) is None  # nothing lags
    lag.left_local(4, _unreachable("down"))
    clock.now = start + 10
    assert lag.over(URI) is None
    clock.now = start + 11
    assert lag.over(URI) == (
        f"{URI}: the oldest step not uploaded was saved 11 s ago, more than RemoteLag(seconds=10) allows "
        f"(steps 4; last failure: {URI}: down)"
    )


def test_attempt_skips_within_the_backoff_and_fails_past_the_limit(clock):
    lag = LagState(RemoteLag(steps=2, retry_after=30))
    calls = []

    def failing():
        calls.append(1)
        raise _unreachable("refused")

    assert lag.attempt(URI, 1, failing) == (
        None,
        f"{URI}: step 1 could not be uploaded; it stays local and committed, and the upload is tried again at a "
        f"later save, wait() or close(). 1 step(s) not uploaded yet (1); last failure: {URI}: refused",
    )
    result, warning = lag.attempt(URI, 2, failing)  # within the backoff: not tried
    assert result is None and calls == [1]
    assert warning.startswith(f"{URI}: step 2 is not uploaded (the remote failed recently); ")
    assert "2 step(s) not uploaded yet (1, 2)" in warning
    with pytest.raises(RemoteLagError) as info:  # a third would pass steps=2: tried, fails, raises
        lag.attempt(URI, 3, failing)
    assert calls == [1, 1] and info.value.path == URI
    assert str(info.value).startswith(f"{URI}: 3 steps not uploaded, more than RemoteLag(steps=2) allows")
    assert isinstance(info.value.__cause__, UploadError)
    assert lag.attempt(URI, 4, lambda: "uploaded") == ("uploaded", None)
    assert lag.report() == remote_lag.RemoteLagReport() and lag.failures == 0


def test_only_an_unreachable_remote_is_tolerated():
    assert tolerated(_unreachable())
    assert not tolerated(UploadError("a lock another writer holds"))  # not marked unreachable
    lost = UploadRankLostError("rank 1 lost mid-upload", ranks=[1])
    lost.unreachable = True
    assert not tolerated(lost)  # a lost rank is never the remote's being down
    storage = StorageError("disk")
    storage.unreachable = True
    assert not tolerated(storage)  # not an upload


@pytest.mark.parametrize(
    ("steps", "text"),
    [
        ([], ""),
        ([7], "7"),
        ([1, 2, 3, 4, 5, 6], "1, 2, 3, 4, 5, 6"),
        ([1, 2, 3, 4, 5, 6, 7], "1, 2, ... 7"),
        ([10, 20, 30, 40, 50, 60, 70, 80], "10, 20, ... 80"),
    ],
    ids=["none", "one", "six", "seven", "eight"],
)
def test_describe_steps_shows_six_and_elides_more(steps, text):
    assert describe_steps(steps) == text
