"""A crashed job's leftover lock, everywhere it shows.

A job that ends without release (os._exit, SIGKILL, a node lost) leaves `ckptlib.lock` in its
root: nothing can remove it at that moment. It is ckptlib's own file and it is stale (its pid
is gone on this host, or on another host its lease is not renewed): `ckpt ls` shows it as a
stale lock the next writer takes over; the read-only paths (`ckpt verify`, `inspect`, `export`,
`manager.steps()`) read the root as it is and leave the lock alone; the next writer (the
relaunch's first load, `ckpt gc`) takes it over by itself with one warning naming the dead
holder, and releases it when done. A live holder's lock is never taken over.

Before: `ckpt ls` printed "locked by pid N ..." for a dead job's lock, as for a live one.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from ckptlib import CheckpointManager, cli
from ckptlib.format.native.root import step_dir
from ckptlib.manager.lock import LEASE_PREFIX, LOCK_NAME, StaleLockWarning

# A job that resumes (taking the root's lock at its first load), saves 1, 2, 3 with keep_last=2
# and dies without any release.
CRASHING_JOB = r"""
import os, sys, torch
from ckptlib import CheckpointManager
mgr = CheckpointManager(sys.argv[1], keep_last=2)
mgr.load({"w": torch.zeros(3)}, fresh_start_ok=True)
for step in (1, 2, 3):
    mgr.save(step, {"w": torch.full((3,), float(step))})
os._exit(3)
"""

CRASHED = [LOCK_NAME, "latest", step_dir(2), step_dir(3)]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A root a crashed job left, and its lock file's bytes (copied per test)."""
    root = tmp_path_factory.mktemp("crashed") / "run"
    done = subprocess.run([sys.executable, "-c", CRASHING_JOB, str(root)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 3, done.stderr
    assert sorted(os.listdir(root)) == CRASHED  # the job ran seconds: no lease renewal was written
    return root


@pytest.fixture
def root(crashed, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(crashed, copy, symlinks=True)
    return copy


def _lock(root) -> dict:
    return json.loads((root / LOCK_NAME).read_text())


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _ls(root, capsys):
    rc, out, err = _run(capsys, "ls", root)
    lock = _lock(root)
    stale = f"stale lock left by pid {lock['pid']} on host {lock['host']}, since {lock['created']}"
    expected = f"{stale} (that process no longer runs): the next writer takes it over"
    assert (rc, err, out.splitlines()[-1]) == (0, "", expected)
    return [line.split()[0] for line in out.splitlines()[1:-1]]


def _ls_json(root, capsys):
    rc, out, err = _run(capsys, "ls", root, "--json")
    listing = json.loads(out)
    lock = {k: v for k, v in _lock(root).items() if k != "format"}
    assert (rc, err, listing["lock"]) == (0, "", {**lock, "stale": "that process no longer runs"})
    return [s["step"] for s in listing["steps"]]


def _verify(root, capsys):
    rc, out, err = _run(capsys, "verify", root)
    assert (rc, err) == (0, "") and out.splitlines()[-1] == f"{root}/{step_dir(3)}: OK"
    return out.splitlines()[-1]


def _inspect(root, capsys):
    rc, out, err = _run(capsys, "inspect", root)
    assert (rc, err) == (0, "")
    return [line for line in out.splitlines() if line.startswith("step:")]


def _export(root, capsys):
    out_file = root.parent / "model.safetensors"
    rc, out, err = _run(capsys, "export", root, out_file, "--no-progress")
    assert (rc, err) == (0, "")
    from safetensors.torch import load_file

    return load_file(out_file)["w"].tolist()


def _steps(root, capsys):
    mgr = CheckpointManager(root)  # a job's manager: it reads, and takes no lock before a load
    try:
        return mgr.steps(), mgr.latest()
    finally:
        mgr.close()


READ_ONLY = {
    "ls": (_ls, ["2", "3"]),
    "ls-json": (_ls_json, [2, 3]),
    "verify": (_verify, None),
    "inspect": (_inspect, ["step:          3"]),
    "export": (_export, [3.0, 3.0, 3.0]),
    "manager-steps": (_steps, ([2, 3], 3)),
}


@pytest.mark.parametrize("path", list(READ_ONLY), ids=list(READ_ONLY))
def test_read_only_paths_read_a_crashed_root_and_leave_its_lock(root, capsys, path):
    show, expected = READ_ONLY[path]
    lock_bytes = (root / LOCK_NAME).read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleLockWarning)  # nothing read-only breaks a lock
        got = show(root, capsys)
    if expected is not None:
        assert got == expected
    assert sorted(os.listdir(root)) == CRASHED
    assert (root / LOCK_NAME).read_bytes() == lock_bytes


def test_gc_takes_a_crashed_job_s_lock_over_and_releases_it(root, capsys):
    lock = _lock(root)
    rc, out, err = _run(capsys, "gc", root, "--keep-last", "1", "--no-progress")
    assert (rc, out) == (0, f"removed {root}/{step_dir(2)}\nremoved 1 step directory\n")
    assert err == (
        f"ckpt gc: warning: {root}: removing a stale lock left by pid {lock['pid']} on host {lock['host']}, "
        f"since {lock['created']} (that process no longer runs)\n"
    )
    assert sorted(os.listdir(root)) == ["latest", step_dir(3)]


def test_gc_dry_run_of_a_crashed_root_removes_nothing(root, capsys):
    rc, out, err = _run(capsys, "gc", root, "--keep-last", "1", "--dry-run", "--no-progress")
    assert (rc, out, err) == (0, f"would remove {root}/{step_dir(2)}\nwould remove 1 step directory\n", "")
    assert sorted(os.listdir(root)) == CRASHED


def test_the_relaunch_takes_the_crashed_job_s_lock_over_at_its_first_load(root):
    lock = _lock(root)
    mgr = CheckpointManager(root, keep_last=2)
    state = {"w": torch.zeros(3)}
    with pytest.warns(StaleLockWarning) as caught:
        assert mgr.load(state) == 3
    assert [str(w.message) for w in caught] == [
        f"{root}: removing a stale lock left by pid {lock['pid']} on host {lock['host']}, since {lock['created']} "
        "(that process no longer runs)"
    ]
    assert torch.equal(state["w"], torch.full((3,), 3.0))
    now = mgr.lock_holder()
    assert (now.host, now.pid) == (socket.gethostname(), os.getpid()) and now.token != lock["token"]
    mgr.save(4, {"w": torch.full((3,), 4.0)})
    mgr.close()
    assert sorted(os.listdir(root)) == ["latest", step_dir(3), step_dir(4)]


def test_the_crashed_job_s_lease_file_goes_with_its_lock(root):
    """A job that held the lock past a quarter of its lease left a lease file beside it: the
    takeover removes both (the lease file is the dead holder's, named by its token)."""
    lease = root / (LEASE_PREFIX + _lock(root)["token"])
    lease.write_text("1.0")  # renewed long ago
    mgr = CheckpointManager(root)
    with pytest.warns(StaleLockWarning, match="that process no longer runs"):
        mgr.load({"w": torch.zeros(3)})
    assert not lease.exists()
    mgr.close()
    assert sorted(os.listdir(root)) == ["latest", step_dir(2), step_dir(3)]


# -- docs/manager.md's "One job per root" block, run ------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_HOLDER = ("4242", "node7", "2026-12-07T20:55:04+00:00")


def _doc_block() -> list[tuple[str, list[str]]]:
    """The commands of docs/manager.md's one-job block and the lines each prints."""
    with open(os.path.join(REPO, "docs", "manager.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("\n## One job per root\n") :]
    block = section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)]
    commands: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:].split("#")[0].strip(), []))
        elif line:
            commands[-1][1].append(line)
    return commands


def _as_shown(text: str, root, lock: dict) -> str:
    """`text` with this run's root and holder where the doc shows /runs/A and its holder."""
    for doc, real in zip(DOC_HOLDER, (str(lock["pid"]), lock["host"], lock["created"])):
        text = text.replace(doc, real)
    return text.replace("/runs/A", str(root))


def test_the_doc_s_second_job_and_crashed_root_commands(root, tmp_path):
    """The second job (examples/train.py, here in a group of one: `python` instead of torchrun)
    prints the doc's LockedError line while a job holds the root; `ckpt ls` of the crashed root
    prints the doc's rows and its stale-lock line."""
    (second, refused), (listing, shown) = _doc_block()
    assert second.startswith("torchrun --nproc-per-node 4 examples/train.py --root /runs/A")
    assert listing == "ckpt ls /runs/A"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}

    ls = subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", "ls", str(root)], capture_output=True, text=True, env=env, timeout=240
    )
    lock = _lock(root)
    out = ls.stdout.splitlines()
    assert (ls.returncode, ls.stderr, len(out)) == (0, "", len(shown))
    assert out[0] == shown[0] and out[-1] == _as_shown(shown[-1], root, lock)
    cells = [(r.split()[0], r.split()[1], r.rstrip().endswith("*")) for r in out[1:-1]]
    assert cells == [(r.split()[0], r.split()[1], r.rstrip().endswith("*")) for r in shown[1:-1]]

    holder = CheckpointManager(root)  # the first job, running: this process
    with pytest.warns(StaleLockWarning):  # it takes the crashed job's lock over
        assert holder.load({"w": torch.zeros(3)}) == 3
    try:
        lock = _lock(root)
        run = subprocess.run(
            [sys.executable, os.path.join(REPO, "examples", "train.py"), "--root", str(root), "--steps", "9"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=240,
        )
    finally:
        holder.close()
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.splitlines()[-1] == _as_shown(refused[0], root, lock)
    assert not os.path.exists(os.path.join(root, step_dir(9)))  # it never trained


def _elsewhere(root, age_s: float) -> dict:
    import datetime

    created = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=age_s)).isoformat(
        timespec="seconds"
    )
    doc = {"format": "ckptlib-lock", "host": "elsewhere.example", "pid": 7, "start": "1", "token": "0" * 32}
    doc.update(created=created, lease_s=120.0)
    (root / LOCK_NAME).write_text(json.dumps(doc))
    return doc


@pytest.mark.parametrize("age_s", [600, 0], ids=["lease-expired-elsewhere", "live-elsewhere"])
def test_ls_tells_a_lock_whose_lease_ran_out_from_a_live_one(root, capsys, age_s):
    """A holder on another host cannot be checked by pid: its lease says whether it is gone."""
    doc = _elsewhere(root, age_s)
    rc, out, err = _run(capsys, "ls", root)
    idle = _idle(out)  # seconds since it was taken, as the listing saw it (600 and what the test took)
    holder = f"pid 7 on host elsewhere.example, since {doc['created']}"
    stale = f"its 120 s lease expired: last taken {idle} s ago" if age_s else None
    expected = (
        f"locked by {holder}" if not age_s else f"stale lock left by {holder} ({stale}): the next writer takes it over"
    )
    assert (rc, err, out.splitlines()[-1]) == (0, "", expected)
    rc, out, err = _run(capsys, "ls", root, "--json")
    if age_s:
        stale = f"its 120 s lease expired: last taken {_idle(out)} s ago"
    assert json.loads(out)["lock"] == {**{k: v for k, v in doc.items() if k != "format"}, "stale": stale}


def _idle(out: str) -> int | None:
    import re

    found = re.search(r"last taken (\d+) s ago", out)
    if found is None:
        return None
    assert 600 <= int(found.group(1)) < 900
    return int(found.group(1))
