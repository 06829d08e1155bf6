"""Progress of saves and loads (issue 37, item 8): `progress=` on `save`, `async_save`, `load`
and `CheckpointManager`, rank 0 only; None draws a bar only on a terminal, True always, False
never, a callable gets `(op, done, total)` in bytes of rank 0's shards; a DEBUG record on
`ckptlib.progress` carries the same for a logging handler."""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import StateError
from ckptlib._runtime import progress as progress_bars
from ckptlib.manager.manager import CheckpointManager


def _state(fill: float = 1.0) -> dict:
    return {"model": {f"w{i}": torch.full((256, 64), fill + i) for i in range(4)}, "step": 1}


def _shard_bytes(path: str) -> int:
    return os.path.getsize(os.path.join(path, "__0_0.distcp"))


@pytest.fixture
def calls(monkeypatch):
    monkeypatch.setattr(progress_bars, "INTERVAL", 0.0)  # every update, not twice a second
    return []


def test_a_save_and_a_load_report_rank_0s_bytes(tmp_path, calls):
    path = str(tmp_path / "c")
    ckptlib.save(path, _state(), progress=lambda *call: calls.append(call))
    tensors = 4 * 256 * 64 * 4
    assert {op for op, _, _ in calls} == {"save"}
    assert calls[-1] == ("save", _shard_bytes(path), tensors)  # the last: everything written
    assert [done for _, done, _ in calls] == sorted(done for _, done, _ in calls) and len(calls) > 2
    calls.clear()
    result = ckptlib.load(path, _state(0.0), progress=lambda *call: calls.append(call))
    assert {op for op, _, _ in calls} == {"load"} and calls[-1][1] == result.storage_bytes_read > 0


def test_an_async_save_reports_from_its_background(tmp_path, calls):
    path = str(tmp_path / "c")
    ckptlib.async_save(path, _state(), progress=lambda *call: calls.append(call)).result()
    assert calls[-1][:2] == ("save", _shard_bytes(path))


def test_the_managers_setting_covers_its_saves_and_loads(tmp_path, calls):
    mgr = CheckpointManager(str(tmp_path / "root"), progress=lambda *call: calls.append(call[0]))
    mgr.save(1, _state())
    assert mgr.load(_state(0.0)) == 1
    assert mgr.load(_state(0.0), progress=False) == 1  # a load's own setting wins
    mgr.close()
    assert calls[0] == "save" and calls[-1] == "load" and set(calls) == {"save", "load"}
    assert calls.count("load") == len(calls) - calls.index("load")


def test_a_bar_only_on_a_terminal_unless_asked(tmp_path, capsys):
    ckptlib.save(str(tmp_path / "a"), _state())  # stderr is not a terminal here: no bar
    ckptlib.save(str(tmp_path / "b"), _state(), progress=False)
    assert capsys.readouterr().err == ""
    ckptlib.save(str(tmp_path / "c"), _state(), progress=True)
    assert "ckptlib save" in capsys.readouterr().err


def test_a_logging_handler_sees_every_update(tmp_path, calls, caplog):
    path = str(tmp_path / "c")
    with caplog.at_level(logging.DEBUG, logger="ckptlib.progress"):
        ckptlib.save(path, _state())
    fields = [r.ckptlib_progress for r in caplog.records if r.name == "ckptlib.progress"]
    assert fields and fields[-1] == {"op": "save", "uri": path, "done": _shard_bytes(path), "total": 4 * 256 * 64 * 4}


def test_a_callback_that_raises_stops_reporting_not_the_save(tmp_path, caplog):
    def broken(op, done, total):
        raise ValueError("display closed")

    path = str(tmp_path / "c")
    ckptlib.save(path, _state(), step=1, progress=broken)
    assert ckptlib.load(path, _state(0.0)).step == 1
    assert "the progress callback raised ValueError: display closed; no more progress for save" in caplog.text


@pytest.mark.parametrize("bad", ["yes", 3])
def test_progress_refuses_other_values(tmp_path, bad):
    message = re.escape(f"progress must be None, True, False or a callable(op, done, total), got {bad!r}")
    with pytest.raises(StateError, match=message):
        ckptlib.save(str(tmp_path / "c"), _state(), progress=bad)
    with pytest.raises(StateError, match=message):
        ckptlib.load(str(tmp_path / "c"), _state(), progress=bad)
    with pytest.raises(StateError, match=message):
        CheckpointManager(str(tmp_path / "root"), progress=bad)
    assert not os.path.exists(tmp_path / "c")  # refused before anything was written


def _report_on_each_rank(path: str) -> int:
    got = []
    ckptlib.save(path, _state(float(dist.get_rank())), progress=lambda *call: got.append(call))
    ckptlib.load(path, _state(0.0), progress=lambda *call: got.append(call))
    return len(got)


def test_only_rank_0_reports(tmp_path, dist_run):
    counts = dist_run(2, _report_on_each_rank, str(tmp_path / "c"), timeout=120)
    assert counts[0] >= 2 and counts[1] == 0
