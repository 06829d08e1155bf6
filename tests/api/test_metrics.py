"""Metrics for TensorBoard and W&B (issue 37, item 8): `ckptlib.on_metrics(fn)` calls
`fn(scalars, step)` on rank 0 after every save, load, upload and gc, whatever the logger's
level, with flat scalars named `ckpt/<op>_<figure>`; a callback that raises is a
MetricsCallbackWarning and never fails the operation."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import ckptlib
from ckptlib import MetricsCallbackWarning, StateError
from ckptlib.manager.manager import CheckpointManager


def _state(fill: float = 1.0) -> dict:
    return {"model": {"w": torch.full((64, 32), fill), "b": torch.full((5,), fill)}, "step": 7}


@pytest.fixture
def reported():
    got: list[tuple[dict, int | None]] = []
    remove = ckptlib.on_metrics(lambda scalars, step: got.append((scalars, step)))
    yield got
    remove()


def test_a_save_and_a_load_report_their_figures(tmp_path, reported):
    path = str(tmp_path / "c")
    saved = ckptlib.save(path, _state(), step=7)
    loaded = ckptlib.load(path, _state(0.0))
    assert [step for _, step in reported] == [7, 7]
    save, load = (scalars for scalars, _ in reported)
    assert sorted(save) == ["ckpt/save_bytes", "ckpt/save_mib_per_s", "ckpt/save_seconds", "ckpt/save_world_size"]
    assert save["ckpt/save_bytes"] == saved.total_bytes and save["ckpt/save_seconds"] == saved.seconds
    assert save["ckpt/save_world_size"] == 1.0
    assert load["ckpt/load_bytes"] == loaded.bytes and load["ckpt/load_seconds"] == loaded.seconds
    assert load["ckpt/load_bytes_read"] == loaded.storage_bytes_read
    assert load["ckpt/load_bytes_by_source_local"] == loaded.bytes_by_source["local"] > 0
    assert load["ckpt/load_saved_world_size"] == 1.0 and load["ckpt/load_world_size"] == 1.0
    assert all(isinstance(v, float) for scalars, _ in reported for v in scalars.values())


def test_an_async_save_reports_how_long_it_blocked(tmp_path, reported):
    handle = ckptlib.async_save(str(tmp_path / "c"), _state(), step=3)
    result = handle.result()
    ((scalars, step),) = reported
    assert step == 3 and scalars["ckpt/save_blocked_seconds"] == result.blocked_seconds
    assert scalars["ckpt/save_seconds"] == result.seconds


def test_the_manager_reports_its_saves_loads_and_gc(tmp_path, reported):
    mgr = CheckpointManager(str(tmp_path / "root"), keep_last=1)
    for step in (1, 2):
        mgr.save(step, _state(float(step)))
    assert mgr.load(_state(0.0)) == 2
    mgr.gc()
    mgr.close()
    ops = [(sorted({name.split("_", 1)[0] for name in scalars}), step) for scalars, step in reported]
    assert ops == [(["ckpt/save"], 1), (["ckpt/save"], 2), (["ckpt/load"], 2), (["ckpt/gc"], None)], ops
    assert reported[-1][0]["ckpt/gc_removed"] == 0.0  # retention already removed step 1


def test_metrics_need_no_logging_and_leave_the_log_line_plain(tmp_path, reported, caplog):
    logging.getLogger("ckptlib").setLevel(logging.WARNING)
    try:
        ckptlib.save(str(tmp_path / "c"), _state())
    finally:
        logging.getLogger("ckptlib").setLevel(logging.NOTSET)
    assert len(reported) == 1 and not [r for r in caplog.records if r.name == "ckptlib"]
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        ckptlib.load(str(tmp_path / "c"), _state(0.0))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ckptlib"]
    assert line.startswith("load step=") and "bytes_read=" in line and "bytes_by_source" not in line, line


def test_a_callback_that_raises_is_warned_and_the_save_stands(tmp_path):
    def broken(scalars, step):
        raise RuntimeError("tensorboard is gone")

    remove = ckptlib.on_metrics(broken)
    try:
        with pytest.warns(MetricsCallbackWarning, match="raised RuntimeError: tensorboard is gone .reporting save of "):
            ckptlib.save(str(tmp_path / "c"), _state(), step=1)
    finally:
        remove()
    state = _state(0.0)
    assert ckptlib.load(str(tmp_path / "c"), state).step == 1 and torch.equal(
        state["model"]["w"], _state()["model"]["w"]
    )


def test_a_removed_callback_is_not_called(tmp_path):
    got = []
    remove = ckptlib.on_metrics(lambda scalars, step: got.append(step))
    ckptlib.save(str(tmp_path / "a"), _state(), step=1)
    remove()
    remove()  # twice is harmless
    ckptlib.save(str(tmp_path / "b"), _state(), step=2)
    assert got == [1]


def test_on_metrics_refuses_what_it_cannot_call():
    with pytest.raises(StateError, match="on_metrics needs a callable, got int 3"):
        ckptlib.on_metrics(3)


def _count_on_each_rank(path: str) -> int:
    got = []
    remove = ckptlib.on_metrics(lambda scalars, step: got.append(scalars))
    ckptlib.save(path, _state(float(dist.get_rank())))
    ckptlib.load(path, _state(0.0))
    remove()
    return len(got)


def test_only_rank_0_reports(tmp_path, dist_run):
    assert dist_run(2, _count_on_each_rank, str(tmp_path / "c"), timeout=120) == [2, 0]
