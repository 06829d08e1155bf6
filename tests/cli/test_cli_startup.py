"""`ckpt`'s help and argument errors come back without importing torch, and a reader that goes
away early (`ckpt ... | head`) ends the command quietly with status 141, as SIGPIPE would.

Before: every command imported torch first (~8 s on a loaded machine, `--help` included), and
`ckpt inspect BIG | head -1` printed "error: [Errno 32] Broken pipe".

The startup check imports the real `ckptlib` package first, as the `ckpt` entry point does:
its public names that need torch are imported on first use (ckptlib/__init__.py), its errors
at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ckptlib
from ckptlib.cli.parser import build_parser

REPO = Path(__file__).resolve().parents[2]

PARSE_ONLY = r"""
import contextlib, io, json, os, sys

sys.path.insert(0, sys.argv[1])
import ckptlib
assert ckptlib.CheckpointError.__module__ == "ckptlib.errors" and "torch" not in sys.modules
from ckptlib.cli import main

results = {}
for argv in json.loads(sys.argv[2]):
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    results[" ".join(argv)] = {"code": code, "torch": "torch" in sys.modules, "first": sink.getvalue().split("\n")[0]}
print(json.dumps(results))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def test_help_and_argument_errors_do_not_import_torch():
    commands = sorted(build_parser()._subparsers._group_actions[0].choices)
    assert {"inspect", "verify", "ls", "plan", "diff", "gc", "convert", "export", "unlock", "validate"} <= set(commands)
    argvs = [["--help"], [], ["--version"]] + [[c, "--help"] for c in commands]
    argvs += [["bench", b, "--help"] for b in ("scale", "tier", "tensors", "async", "read-once")]
    argvs += [["inspect"], ["verify", "x", "--step", "seven"], ["gc"], ["no-such-command"], ["ls", "--bogus", "r"]]
    argvs += [["bench", "--bogus"], ["bench", "scale", "--worlds", "many"]]
    run = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, str(REPO), json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    assert {argv: r["torch"] for argv, r in results.items()} == {" ".join(a): False for a in argvs}
    codes = {argv: r["code"] for argv, r in results.items()}
    quiet_ok = {"", "--version"}  # a bare `ckpt` prints its help; --version its version
    assert codes == {" ".join(a): 0 if "--help" in a or " ".join(a) in quiet_ok else 2 for a in argvs}
    assert results["--help"]["first"] == "usage: ckpt [-h] [--version] COMMAND ..."
    assert results[""]["first"] == results["--help"]["first"]
    assert results["--version"]["first"] == f"ckpt (ckptlib) {ckptlib.__version__}"
    assert results["inspect --help"]["first"].startswith("usage: ckpt inspect [-h]")
    assert results["bench scale --help"]["first"].startswith("usage: ckpt bench scale [-h]")


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """A real pipe: the reader takes one line and closes it while the command still writes
    (its output is several times a pipe's buffer), as `ckpt inspect BIG | head -1` does."""
    ckptlib.save(tmp_path / "big", {f"layers.{i}.attention.projection.weight": torch.zeros(1) for i in range(3000)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptlib.cli", "inspect", str(tmp_path / "big")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=_env(),
    )
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141
    assert first == f"checkpoint:    {tmp_path / 'big'}\n".encode() and err == b""


def test_a_pipe_closed_before_the_first_line(tmp_path):
    mgr = ckptlib.CheckpointManager(tmp_path / "run")
    mgr.save(1, {"w": torch.ones(2)})
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "ckptlib.cli", "ls", str(tmp_path / "run")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=_env(),
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert (run.returncode, run.stderr) == (141, b"")


def test_ls_of_a_root_reads_its_manifests_without_importing_torch(tmp_path):
    """`ckpt ls ROOT` of a ckptlib root (text and --json) lists every step from the manifests
    and the lock file alone: torch is never imported (it was, through the manager, the presets
    and the format package: ~3.4 s a listing on this machine, now ~0.4 s)."""
    mgr = ckptlib.CheckpointManager(tmp_path / "run", hold_lock=True)
    mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 0.5})
    mgr.save(2, {"w": torch.ones(2)})
    script = PARSE_ONLY.replace('"first": sink.getvalue().split("\\n")[0]', '"out": sink.getvalue()')
    argvs = [["ls", str(tmp_path / "run")], ["ls", str(tmp_path / "run"), "--json"]]
    run = subprocess.run(
        [sys.executable, "-c", script, str(REPO), json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=300,
    )
    mgr.close()
    assert run.returncode == 0, run.stderr
    text, as_json = json.loads(run.stdout).values()
    assert (text["code"], text["torch"], as_json["code"], as_json["torch"]) == (0, False, 0, False)
    rows = [line.split() for line in text["out"].splitlines()]
    assert rows[0] == ["step", "state", "world", "size", "age", "latest", "metrics"]
    assert [r[:3] for r in rows[1:3]] == [["1", "committed", "1"], ["2", "committed", "1"]]
    assert rows[1][-1] == "loss=0.5" and rows[2][-1] == "*"
    assert rows[3][:2] == ["locked", "by"] and f"pid {os.getpid()}" in text["out"]
    listing = json.loads(as_json["out"])
    assert [(s["step"], s["state"], s["latest"]) for s in listing["steps"]] == [
        (1, "committed", False),
        (2, "committed", True),
    ]
    assert listing["latest"] == "step_0000000002" and listing["lock"]["pid"] == os.getpid()


def test_the_format_package_names_its_functions_on_first_use():
    """`ckptlib.format` imports its public names on first use (so `ckpt ls` needs no torch), and
    each is what it was when the package imported them at once: `ckptlib.format.verify` is the
    function, also after its module of the same name was imported (the import sets it here)."""
    import importlib

    import ckptlib.format as package

    module = importlib.import_module("ckptlib.format.verify")
    assert package.verify is module.verify and callable(package.verify)
    assert sorted(package.__all__) == sorted(package._ON_USE)
    for name in package.__all__:
        assert getattr(package, name) is getattr(importlib.import_module(package._ON_USE[name]), name)
