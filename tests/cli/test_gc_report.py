"""`ckpt gc` reports what it did: the directories a dry run lists are exactly the ones the real
run lists, and exactly the ones gone from the root afterwards, for every kind of root (plain,
a step holding a user's file, a damaged and an uncommitted step, what a crashed deletion left,
a locked root); its warnings are one line each (`ckpt gc: warning: ...`), never Python's
`file:line: Category:` header and the source line of `sys.exit(main())`.

Before: a step kept for a user's file was reported `removed .../step_N` (and counted), the dry
run listed it too; a dry run of a locked root listed removals the real run refused; a warning
printed `.../ckptlib/cli/__main__.py:8: ForeignFilesWarning: ...` and `  sys.exit(main())`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from ckptlib import CheckpointManager, cli
from ckptlib.format.native.root import step_dir
from ckptlib.manager.cleanup import ForeignFilesWarning
from ckptlib.manager.lock import LOCK_NAME

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steps(root, *steps: int) -> None:
    mgr = CheckpointManager(root)
    for step in steps:
        mgr.save(step, {"w": torch.full((3,), float(step))})


def _debris(root, name: str, extra: dict[str, bytes] | None = None) -> None:
    """A save that never committed (or a deletion that crashed), with `extra` files."""
    path = os.path.join(root, name)
    os.makedirs(path)
    for file, data in {"ckptlib.pending": b"{}", "__0_0.distcp": b"half", **(extra or {})}.items():
        with open(os.path.join(path, file), "wb") as f:
            f.write(data)


def plain(root):
    _steps(root, 1, 2, 3)
    return [step_dir(1), step_dir(2)], []


def users_file(root):
    _steps(root, 1, 2, 3)
    with open(os.path.join(root, step_dir(1), "eval.txt"), "w") as f:
        f.write("a user's notes")
    return [step_dir(2)], [(step_dir(1), "eval.txt")]


def damaged_and_uncommitted(root):
    _steps(root, 1, 2, 3)
    with open(os.path.join(root, step_dir(1), "ckptlib.json"), "w") as f:
        f.write("{")  # a damaged manifest
    _debris(root, step_dir(5))  # a save that crashed before its commit
    _debris(root, step_dir(6), {"notes.md": b"mine"})  # the same, with a user's file in it
    _debris(root, step_dir(7) + ".deleting-0123abcd")  # a deletion that crashed
    return [step_dir(1), step_dir(2), step_dir(5), step_dir(7) + ".deleting-0123abcd"], [(step_dir(6), "notes.md")]


ROOTS = {"plain": plain, "users-file": users_file, "damaged-and-uncommitted": damaged_and_uncommitted}


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _warning(root, name: str, file: str, dry: bool) -> str:
    verb = "would remove the checkpoint's own files and leave" if dry else "removed the checkpoint's own files and left"
    return (
        f"ckpt gc: warning: {root}/{name} holds files ckptlib did not write: {file}; {verb} the directory with "
        "those in place"
    )


@pytest.mark.parametrize("kind", list(ROOTS))
def test_dry_run_lists_what_the_real_run_removes(kind, tmp_path, capsys):
    root = str(tmp_path / "run")
    removed, kept = ROOTS[kind](root)
    before = set(os.listdir(root))
    rc, dry_out, dry_err = _run(capsys, "gc", root, "--keep-last", "1", "--dry-run", "--no-progress")
    assert rc == 0 and set(os.listdir(root)) == before
    rc, out, err = _run(capsys, "gc", root, "--keep-last", "1", "--no-progress")
    assert rc == 0
    gone = before - set(os.listdir(root))
    noun = "directory" if len(removed) == 1 else "directories"
    assert dry_out.splitlines() == [f"would remove {root}/{n}" for n in removed] + [
        f"would remove {len(removed)} step {noun}"
    ]
    assert out.splitlines() == [f"removed {root}/{n}" for n in removed] + [f"removed {len(removed)} step {noun}"]
    assert gone == set(removed)
    assert dry_err.splitlines() == [_warning(root, name, file, dry=True) for name, file in kept]
    assert err.splitlines() == [_warning(root, name, file, dry=False) for name, file in kept]
    for name, file in kept:
        assert os.listdir(os.path.join(root, name)) == [file]  # only the user's file is left
    rc, out, err = _run(capsys, "gc", root, "--keep-last", "1", "--no-progress")
    assert (rc, out, err) == (0, "removed 0 step directories\n", "")  # a user's directory is never touched again


def test_the_library_reports_the_same(tmp_path):
    """`CheckpointManager.gc` returns what went, dry or not, and warns alike."""
    root = str(tmp_path / "run")
    removed, _ = users_file(root)
    mgr = CheckpointManager(root, keep_last=1)
    with pytest.warns(ForeignFilesWarning, match="would remove the checkpoint's own files"):
        assert mgr.gc(dry_run=True) == removed
    with pytest.warns(ForeignFilesWarning, match="removed the checkpoint's own files"):
        assert mgr.gc() == removed


@pytest.mark.parametrize("force", [False, True], ids=["locked", "locked-force"])
def test_a_locked_root_dry_run_says_what_the_real_run_does(force, tmp_path, capsys):
    root = str(tmp_path / "run")
    removed, _ = plain(root)
    with open(os.path.join(root, LOCK_NAME), "w") as f:
        json.dump({"host": "elsewhere.example", "pid": 7, "token": "x", "created": "then"}, f)
    before = set(os.listdir(root))
    flags = ["--keep-last", "1", "--no-progress"] + (["--force"] if force else [])
    dry = _run(capsys, "gc", root, "--dry-run", *flags)
    assert set(os.listdir(root)) == before
    real = _run(capsys, "gc", root, *flags)
    gone = before - set(os.listdir(root))
    holder = "pid 7 on host elsewhere.example, since then"
    if not force:
        assert dry == real and real[:2] == (1, "") and gone == set()
        assert real[2].startswith(f"ckpt gc: error: {root} is locked by another writer: {holder}")
        return
    assert dry == (
        0,
        "\n".join([f"would remove the lock held by {holder}"] + [f"would remove {root}/{n}" for n in removed])
        + "\nwould remove 2 step directories\n",
        "",
    )
    assert real == (
        0,
        "\n".join([f"removed the lock held by {holder}"] + [f"removed {root}/{n}" for n in removed])
        + "\nremoved 2 step directories\n",
        "",
    )
    assert gone == set(removed) | {LOCK_NAME}


def test_a_warning_is_one_line_from_the_real_command(tmp_path):
    """The installed entry point (`python -m ckptlib.cli`): stderr is exactly the warning line."""
    root = str(tmp_path / "run")
    users_file(root)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", "gc", root, "--keep-last", "1", "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == _warning(root, step_dir(1), "eval.txt", dry=False) + "\n"
    assert done.stdout == f"removed {root}/{step_dir(2)}\nremoved 1 step directory\n"


def test_a_stale_lock_is_removed_with_a_one_line_warning(tmp_path, capsys):
    """A lock left by a process of this host that no longer runs: the dry run passes it (the
    real run removes it) and lists the same removals; the real run's warning is one line."""
    root = str(tmp_path / "run")
    removed, _ = plain(root)
    gone_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone_pid.stdout)
    lock = {"host": socket.gethostname(), "pid": pid, "token": "t", "created": "then"}
    with open(os.path.join(root, LOCK_NAME), "w") as f:
        json.dump(lock, f)
    dry = _run(capsys, "gc", root, "--keep-last", "1", "--dry-run", "--no-progress")
    real = _run(capsys, "gc", root, "--keep-last", "1", "--no-progress")
    assert dry[:2] == (0, "".join(f"would remove {root}/{n}\n" for n in removed) + "would remove 2 step directories\n")
    assert real[:2] == (0, "".join(f"removed {root}/{n}\n" for n in removed) + "removed 2 step directories\n")
    assert dry[2] == ""
    assert real[2] == (
        f"ckpt gc: warning: {root}: removing a stale lock left by pid {pid} on host {socket.gethostname()}, since "
        "then (that process no longer runs)\n"
    )
    assert sorted(os.listdir(root)) == ["latest", step_dir(3)]
