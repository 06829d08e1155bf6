"""Nothing outlives its run: SIGKILL a running test suite's pytest (a CI timeout, a closed
terminal) and every process it started ends with it, within seconds: its xdist worker, the
fake-gcs-server emulator (started in a session of its own), the rank forkserver and its ranks,
and ckptlib's async writer process.

Before: the xdist worker, the emulator and (through them) the forkserver and writer kept running
after their pytest was gone, competing with the next run for ports and cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

INNER_CONFTEST = 'pytest_plugins = ["ckptlib.testing.plugin"]\n'

INNER_TEST = textwrap.dedent(
    """
    import os, time

    import torch

    import ckptlib
    from ckptlib.saving import writer_process


    def _rank(ready):
        Path = __import__("pathlib").Path
        Path(ready, f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
        time.sleep(600)


    def test_runs_until_killed(gcs_server, tmp_path, dist_run):
        ready = os.environ["CKPTLIB_TEST_READY"]
        handle = ckptlib.async_save(str(tmp_path / "c"), {"w": torch.ones(4)}, async_mode="process")
        handle.wait()
        open(os.path.join(ready, "writer"), "w").write(str(writer_process.current().pid))
        dist_run(2, _rank, ready)
    """
)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a PID 1 that does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("workers", [["-n", "1"], ["-p", "no:xdist"]], ids=["xdist", "single-process"])
def test_sigkill_of_a_running_suite_leaves_no_process(tmp_path, workers):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(INNER_CONFTEST)
    (suite / "test_inner.py").write_text(INNER_TEST)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {**os.environ, "CKPTLIB_TEST_READY": str(ready), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "test_inner.py"],
        cwd=suite,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while not {"writer", "rank0", "rank1"} <= set(os.listdir(ready)):
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the inner suite never got its processes running"
            time.sleep(0.2)
        started = _descendants(proc.pid)
        named = {int((ready / name).read_text()) for name in ("writer", "rank0", "rank1")}
        assert named <= started  # the writer and the ranks are the suite's own descendants
        commands = {pid: _command(pid) for pid in started}
        assert [c for c in commands.values() if "fake-gcs-server" in c], commands
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {pid: commands[pid] for pid in started if _running(pid)} == {}
    finally:  # whatever the outcome, nothing of the inner suite is left for the next test
        for pid in [proc.pid, *_descendants(proc.pid), *started]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
