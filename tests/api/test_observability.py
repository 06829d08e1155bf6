"""Observability: one INFO line per save/load/export/gc on rank 0 with the figures the results
carry, progress bars only on a terminal, and `ckpt ls` with size, age, world size, metrics."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
import threading

import pytest
import torch

import ckptlib
from ckptlib.manager.manager import CheckpointManager

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ckptlib_records(caplog, op: str) -> list[dict]:
    return [r.ckptlib for r in caplog.records if r.name == "ckptlib" and getattr(r, "ckptlib", {}).get("op") == op]


def _check_line(caplog, fields: dict) -> None:
    """The text line says what the fields say."""
    [record] = [r for r in caplog.records if getattr(r, "ckptlib", None) is fields]
    text = record.getMessage()
    assert text.startswith(f"{fields['op']} step=")
    for key, label in (("bytes", "bytes"), ("world_size", "world_size")):
        assert f" {label}={'-' if fields[key] is None else fields[key]}" in text
    assert " seconds=" in text and " MiB/s=" in text and text.endswith(f"uri={fields['uri']}")
    assert record.levelno == logging.INFO


def test_sync_save_load_log_and_results(tmp_path, caplog):
    state = {"model": {"w": torch.arange(1024, dtype=torch.float32)}, "epoch": 1}
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        saved = ckptlib.save(str(tmp_path / "c"), state, step=11)
        loaded = ckptlib.load(str(tmp_path / "c"), state)
    manifest = json.loads((tmp_path / "c" / "ckptlib.json").read_text())
    size = sum(f["size"] for f in manifest["files"].values())
    assert (saved.bytes, saved.total_bytes, saved.world_size, saved.step) == (size, size, 1, 11)
    assert saved.seconds > 0 and saved.blocked_seconds is None
    assert saved.mib_per_s == pytest.approx(size / 2**20 / saved.seconds)
    assert (loaded.bytes, loaded.world_size, loaded.load_world_size) == (size, 1, 1) and loaded.seconds > 0

    [save_line] = _ckptlib_records(caplog, "save")
    assert (save_line["step"], save_line["bytes"], save_line["world_size"]) == (11, size, 1)
    assert save_line["seconds"] == saved.seconds and "blocked_seconds" not in save_line
    _check_line(caplog, save_line)
    [load_line] = _ckptlib_records(caplog, "load")
    assert (load_line["step"], load_line["bytes"], load_line["world_size"], load_line["saved_world_size"]) == (
        11,
        size,
        1,
        1,
    )
    assert load_line["seconds"] == loaded.seconds
    _check_line(caplog, load_line)


def test_async_save_logs_blocked_and_total(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        mgr = CheckpointManager(str(tmp_path / "root"), async_save=True)
        handle = mgr.save(3, {"w": torch.ones(4096)})
        result = handle.wait()
        mgr.close()
    [line] = _ckptlib_records(caplog, "save")
    assert line["async"] is True and line["step"] == 3 and line["bytes"] == result.bytes
    assert line["blocked_seconds"] == result.blocked_seconds == handle.blocking_seconds
    assert 0 <= result.blocked_seconds <= result.seconds == line["seconds"]
    text = [r.getMessage() for r in caplog.records if getattr(r, "ckptlib", None) is line][0]
    assert " async blocked_seconds=" in text
    _check_line(caplog, line)


def test_gc_logs_what_it_removed(tmp_path, caplog):
    root = tmp_path / "root"
    mgr = CheckpointManager(str(root))
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((256,), float(step))})
    doomed = sum(p.stat().st_size for d in ("step_0000000001", "step_0000000002") for p in (root / d).iterdir())
    seen = []
    with caplog.at_level(logging.INFO, logger="ckptlib"):
        removed = CheckpointManager(str(root), keep_last=1).gc(
            on_removed=lambda done, total: seen.append((done, total))
        )
    assert removed == ["step_0000000001", "step_0000000002"]
    assert seen == [(0, 2), (1, 2), (2, 2)]
    [line] = _ckptlib_records(caplog, "gc")
    assert (line["bytes"], line["removed"], line["dry_run"], line["world_size"], line["step"]) == (
        doomed,
        2,
        False,
        1,
        None,
    )
    _check_line(caplog, line)


def _rank_logs(root: str) -> list[dict]:
    """Save and load at this rank; the ckptlib INFO records this rank emitted."""
    import torch.distributed as dist

    records: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if hasattr(record, "ckptlib"):
                records.append(dict(record.ckptlib))

    logger = logging.getLogger("ckptlib")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    state = {"w": torch.full((8,), float(dist.get_rank()))}
    mgr = CheckpointManager(root)
    mgr.save(5, state)
    mgr.load(state)
    mgr.gc()
    return records


def test_only_rank0_logs_with_the_world_size(tmp_path, dist_run):
    per_rank = dist_run(3, _rank_logs, str(tmp_path / "root"))
    assert per_rank[1] == [] and per_rank[2] == []
    assert [r["op"] for r in per_rank[0]] == ["save", "load", "gc"]
    assert all(r["world_size"] == 3 for r in per_rank[0])
    assert per_rank[0][1]["saved_world_size"] == 3 and per_rank[0][0]["step"] == per_rank[0][1]["step"] == 5


# --------------------------------------------------------------------------- progress bars


def _terminal() -> tuple[int, int]:
    master, slave = pty.openpty()
    # A fresh pty is 0x0 and tqdm would draw a zero-width bar: give it a terminal's size.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    return master, slave


def _drain(master: int, sink: list[bytes]) -> None:
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # every writer closed the terminal
            return
        if not data:
            return
        sink.append(data)


def _run_cli(args: list[str], *, tty: bool) -> tuple[int, str]:
    """`ckpt ARGS` in this process with stderr on a pseudo-terminal (tty=True) or a pipe-like
    file; returns its exit status and stderr text."""
    from ckptlib.cli import main

    if not tty:
        buf = io.StringIO()  # not a terminal, like a pipe
        with contextlib.redirect_stderr(buf):
            rc = main(args)
        return rc, buf.getvalue()
    master, slave = _terminal()
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, chunks), daemon=True)
    reader.start()
    with open(slave, "w", closefd=True) as stream, contextlib.redirect_stderr(stream):
        rc = main(args)
        stream.flush()
    reader.join(timeout=30)
    os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


def _run_cli_process(args: list[str], *, tty: bool) -> tuple[int, str]:
    """Like _run_cli in a child process (for `ckpt validate`, whose ranks write the bar)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "ckptlib.cli", *args]
    if not tty:
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
        return proc.returncode, proc.stderr
    master, slave = _terminal()
    chunks: list[bytes] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    _drain(master, chunks)
    os.close(master)
    return proc.wait(timeout=300), b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def root_with_steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress") / "root"
    mgr = CheckpointManager(str(root))
    for step in (1, 2, 3):
        mgr.save(step, {"model": {"w": torch.full((64 * 1024,), float(step))}})
    return root


def _commands(root, tmp) -> dict[str, tuple[list[str], str]]:
    return {
        "verify": (["verify", str(root / "step_0000000003")], "ckpt verify"),
        "convert": (
            ["convert", str(root / "step_0000000003"), str(tmp / "conv"), "--to", "safetensors"],
            "-> safetensors",
        ),
        "export": (["export", str(root), str(tmp / "exp"), "--model-only"], "export safetensors"),
        "gc": (["gc", str(root), "--keep", "2"], "ckpt gc"),
    }


@pytest.mark.parametrize("mode", ["tty", "piped", "no-progress"])
@pytest.mark.parametrize("command", ["verify", "convert", "export", "gc"])
def test_progress_bar_only_on_a_terminal(tmp_path, root_with_steps, command, mode):
    root = tmp_path / "root"
    shutil.copytree(root_with_steps, root, symlinks=True)
    args, marker = _commands(root, tmp_path)[command]
    if mode == "no-progress":
        args = args + ["--no-progress"]
    rc, err = _run_cli(args, tty=mode != "piped")
    assert rc == 0, err
    if mode == "tty":
        assert marker in err and "\r" in err, err
    else:
        assert marker not in err and "\r" not in err, err


@pytest.mark.parametrize("mode", ["tty", "no-progress"])
def test_validate_progress_only_on_a_terminal(tmp_path, mode):
    args = ["validate", "--world-sizes", "1", "--wrap", "plain", "--root", str(tmp_path / "val")]
    rc, err = _run_cli_process(args + (["--no-progress"] if mode == "no-progress" else []), tty=True)
    assert rc == 0, err
    assert ("ckpt validate" in err) == (mode == "tty"), err


# --------------------------------------------------------------------------- ckpt ls


def test_ls_shows_size_age_world_and_metrics(tmp_path, capsys):
    from ckptlib.cli import main

    root = tmp_path / "root"
    mgr = CheckpointManager(str(root))
    mgr.save(1, {"w": torch.ones(300)}, metrics={"loss": 0.25, "acc": 0.875})
    assert main(["ls", "--json", str(root)]) == 0
    doc = json.loads(capsys.readouterr().out)
    [step] = doc["steps"]
    files = list((root / "step_0000000001").iterdir())
    assert step["bytes"] == sum(p.stat().st_size for p in files) and step["world_size"] == 1
    assert 0 <= step["age_seconds"] < 600 and step["created"]
    assert step["metrics"] == {"loss": 0.25, "acc": 0.875}
    assert main(["ls", str(root)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split()[:3] == ["1", "committed", "1"] and line.split()[5].endswith("s")
    assert line.endswith("acc=0.875 loss=0.25")
