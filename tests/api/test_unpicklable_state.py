"""A state value that cannot be pickled (a lambda, an open file, a lock, a socket, a generator)
is a StateError naming its full dotted key, raised on every rank before anything is written:
no checkpoint directory, no ckptlib.pending, no shard; `latest` stays where it was."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib.format.native.root import step_dir


def _open_file():
    return open(__file__)


def _socket():
    return socket.socket()


UNPICKLABLE = {
    "lambda": lambda: lambda x: x,
    "open-file": _open_file,
    "lock": threading.Lock,
    "socket": _socket,
    "generator": lambda: (i for i in range(3)),
}


def _state(bad) -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "extra": {"epoch": 3, "callback": bad}}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", list(UNPICKLABLE), ids=list(UNPICKLABLE))
def test_save_refuses_unpicklable_value_before_writing(tmp_path, kind, mode):
    bad = UNPICKLABLE[kind]()
    target = tmp_path / "ckpt"
    with pytest.raises(
        ckptlib.StateError, match=r"^state value extra\.callback \(\w+\) cannot be saved: it does not pickle"
    ):
        (ckptlib.async_save if mode == "async" else ckptlib.save)(str(target), _state(bad), step=1)
    assert not target.exists()
    if hasattr(bad, "close"):
        bad.close()


def test_nested_unpicklable_value_is_named_by_its_full_path(tmp_path):
    state = {"w": torch.ones(2), "extra": {"hooks": [1, {"on_step": lambda: 0}]}}
    with pytest.raises(ckptlib.StateError, match=r"^state value extra\.hooks\.1\.on_step \(function\)"):
        ckptlib.save(str(tmp_path / "c"), state)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_manager_refuses_unpicklable_value_and_keeps_latest(tmp_path, async_save):
    root = tmp_path / "run"
    with ckptlib.CheckpointManager(root, async_save=async_save) as mgr:
        first = mgr.save(1, _state(1))
        if async_save:
            first.wait(timeout=60)
        with pytest.raises(ckptlib.StateError, match=r"^state value extra\.callback \(function\)"):
            mgr.save(2, _state(lambda: 0))
        assert not (root / step_dir(2)).exists()
        assert mgr.latest() == 1 and mgr.steps() == [1]
        second = mgr.save(2, _state(2))  # the next save with a good state goes ahead
        if async_save:
            second.wait(timeout=60)
    assert sorted(os.listdir(root)) == ["latest", step_dir(1), step_dir(2)]
    assert ckptlib.CheckpointManager(root).latest() == 2


def _one_rank_has_a_lambda(uri: str, async_: bool) -> str:
    bad = (lambda: 0) if dist.get_rank() == 1 else 7
    try:
        (ckptlib.async_save if async_ else ckptlib.save)(uri, _state(bad), step=1)
    except ckptlib.StateError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unpicklable_value_on_one_rank_raises_on_every_rank(tmp_path, dist_run, mode):
    uri = str(tmp_path / "ckpt")
    errors = dist_run(2, _one_rank_has_a_lambda, uri, mode == "async")
    for rank, err in enumerate(errors):
        assert err.startswith("StateError: state value extra.callback (function) cannot be saved"), (rank, err)
    assert not os.path.exists(uri)
