"""The `ckpt` command: verify, inspect, ls, gc, unlock; exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, cli
from ckptlib.manager.lock import LOCK_NAME

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def _ckpt(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if rc == 0:
        assert err == ""
    else:
        assert len(err.strip().splitlines()) <= 1, err
    return rc, out, err


def _root_with_steps(root):
    mgr = CheckpointManager(root)
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4, 3), float(step)), "n": step}, metadata={"step": step})
    debris = root / "step_0000000003"
    debris.mkdir()
    (debris / "ckptlib.pending").write_text("{}")
    (debris / "__0_0.distcp").write_bytes(b"partial")
    return mgr


# ---------------------------------------------------------------- verify and inspect


def test_verify_intact(tmp_path, capsys):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(3)})
    assert _ckpt(capsys, "verify", tmp_path / "c") == (0, f"{tmp_path / 'c'}: OK\n", "")


@pytest.mark.parametrize(
    "make, message",
    [
        pytest.param(lambda p: None, "the path does not exist", id="missing"),
        pytest.param(lambda p: p.write_bytes(b"x"), "is a file, not a checkpoint directory", id="a-file"),
        pytest.param(
            lambda p: (p.mkdir(), (p / "notes.txt").write_text("hi")), "is not a checkpoint", id="unrelated-files"
        ),
    ],
)
def test_verify_and_inspect_not_a_checkpoint_exit_2(tmp_path, capsys, make, message):
    target = tmp_path / "x"
    make(target)
    for command in ("verify", "inspect"):
        rc, out, err = _ckpt(capsys, command, target)
        assert rc == 2 and out == "" and err.startswith(f"ckpt {command}: error: ") and message in err


def test_bad_uri_is_a_usage_error(capsys):
    rc, _, err = _ckpt(capsys, "verify", "ftp://host/ckpt")
    assert rc == 2 and "unsupported URI scheme" in err


def test_inspect_ckptlib_checkpoint(tmp_path, capsys):
    path = tmp_path / "c"
    model = torch.nn.Linear(5, 3)
    ckptlib.save(path, {"model": model, "half": torch.ones(2, 2).half(), "epoch": 4}, step=12)
    rc, out, _ = _ckpt(capsys, "inspect", "--json", path)
    assert rc == 0
    doc = json.loads(out)
    assert list(doc) == ["format", "step", "world_size", "torch_version", "total_bytes", "tensors", "objects", "root"]
    assert (doc["objects"], doc["root"]) == (["epoch"], None)
    manifest = json.loads((path / "ckptlib.json").read_text())
    assert doc["format"] == "ckptlib" and doc["step"] == 12 and doc["world_size"] == 1
    assert doc["torch_version"] == torch.__version__
    assert doc["total_bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert doc["tensors"] == [
        {"key": "half", "shape": [2, 2], "dtype": "float16", "chunks": 1},
        {"key": "model.bias", "shape": [3], "dtype": "float32", "chunks": 1},
        {"key": "model.weight", "shape": [3, 5], "dtype": "float32", "chunks": 1},
    ]
    rc, out, _ = _ckpt(capsys, "inspect", path)
    assert rc == 0
    lines = out.splitlines()
    assert lines[:7] == [
        f"checkpoint:    {path}",
        "format:        ckptlib",
        "step:          12",
        "world size:    1",
        f"torch version: {torch.__version__}",
        f"total bytes:   {doc['total_bytes']}",
        "tensors:       3",
    ]
    assert lines[-2:] == ["objects:       1", "  epoch"]
    assert lines[9].split() == ["model.weight", "(3,", "5)", "float32", "1", "chunk"]


def test_inspect_plain_dcp_fixture(capsys):
    path = os.path.join(FIXTURES, "dcp_dtensor_torch2.13", "ckpt")
    rc, out, _ = _ckpt(capsys, "inspect", "--json", path)
    assert rc == 0
    doc = json.loads(out)
    assert (doc["format"], doc["step"], doc["world_size"], doc["torch_version"]) == ("dcp", None, 2, None)
    assert doc["total_bytes"] == sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    assert any(t["chunks"] == 2 for t in doc["tensors"])  # sharded at save time
    assert all(set(t) == {"key", "shape", "dtype", "chunks"} for t in doc["tensors"])
    rc, out, _ = _ckpt(capsys, "verify", path)
    assert rc == 0 and out.splitlines()[-1] == f"{path}: OK" and out.startswith("note: ")


def test_inspect_does_not_need_the_shards(tmp_path, capsys):
    path = tmp_path / "c"
    ckptlib.save(path, {"w": torch.ones(3)}, step=1)
    os.unlink(path / "__0_0.distcp")
    rc, out, _ = _ckpt(capsys, "inspect", "--json", path)
    assert rc == 0 and json.loads(out)["tensors"] == [{"key": "w", "shape": [3], "dtype": "float32", "chunks": 1}]
    rc, out, _ = _ckpt(capsys, "verify", path)
    assert rc == 1 and f"{path}/__0_0.distcp (rank 0's shard): is missing" in out


def test_inspect_incomplete_is_exit_1(tmp_path, capsys):
    path = tmp_path / "c"
    path.mkdir()
    (path / "ckptlib.pending").write_text("{}")
    (path / "__0_0.distcp").write_bytes(b"x")
    rc, _, err = _ckpt(capsys, "inspect", path)
    assert rc == 1 and "uncommitted checkpoint" in err
    rc, out, _ = _ckpt(capsys, "verify", path)
    assert (
        rc == 1 and f"{path}/ckptlib.json: is missing: a save started here (ckptlib.pending) but never committed" in out
    )


# ---------------------------------------------------------------- ls, gc, unlock


def test_ls_text_and_json(tmp_path, capsys):
    root = tmp_path / "run"
    _root_with_steps(root)
    rc, out, _ = _ckpt(capsys, "ls", "--json", root)
    assert rc == 0
    doc = json.loads(out)
    assert doc["root"] == str(root) and doc["latest"] == "step_0000000002" and doc["lock"] is None
    assert [(s["step"], s["state"], s["world_size"], s["latest"]) for s in doc["steps"]] == [
        (1, "committed", 1, False),
        (2, "committed", 1, True),
        (3, "incomplete", None, False),
    ]
    assert doc["steps"][2]["bytes"] == len(b"partial") + 2
    assert doc["steps"][0]["bytes"] == sum(p.stat().st_size for p in (root / "step_0000000001").iterdir())
    assert all(0 <= s["age_seconds"] < 600 for s in doc["steps"][:2]) and doc["steps"][2]["age_seconds"] is None
    rc, out, _ = _ckpt(capsys, "ls", root)
    lines = out.splitlines()
    assert lines[0].split() == ["step", "state", "world", "size", "age", "latest", "metrics"]
    size = f"{doc['steps'][0]['bytes'] / 1024:.1f}"
    assert lines[1].split()[:5] == ["1", "committed", "1", size, "KiB"] and not lines[1].endswith("*")
    assert lines[2].split()[:3] == ["2", "committed", "1"] and lines[2].endswith("*")
    assert lines[3].split() == ["3", "incomplete", "-", str(len(b"partial") + 2), "B", "-"]
    assert len(lines) == 4


def test_ls_shows_the_lock_and_a_corrupt_manifest(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root, hold_lock=True) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        (root / "step_0000000001" / "ckptlib.json").write_text("{")
        rc, out, _ = _ckpt(capsys, "ls", root)
        assert rc == 0
        assert out.splitlines()[1].split()[:3] == ["1", "corrupt", "-"]
        assert out.splitlines()[-1].startswith(
            f"locked by pid {os.getpid()} on host {socket.gethostname()} (this process)"
        )
        rc, out, _ = _ckpt(capsys, "ls", "--json", root)
        assert json.loads(out)["lock"]["pid"] == os.getpid()


def test_ls_missing_root(tmp_path, capsys):
    rc, out, err = _ckpt(capsys, "ls", tmp_path / "nope")
    assert (rc, out) == (2, "") and err == f"ckpt ls: error: {tmp_path / 'nope'}: no such checkpoint root\n"


def test_gc_dry_run_then_real(tmp_path, capsys):
    root = tmp_path / "run"
    _root_with_steps(root)
    rc, out, _ = _ckpt(capsys, "gc", root, "--keep", "1", "--dry-run")
    assert rc == 0 and out.splitlines() == [
        f"would remove {root}/step_0000000001",
        f"would remove {root}/step_0000000003",
        "would remove 2 step directories",
    ]
    assert sorted(os.listdir(root)) == ["latest", "step_0000000001", "step_0000000002", "step_0000000003"]
    rc, out, _ = _ckpt(capsys, "gc", root, "--keep", "1")
    assert rc == 0 and out.splitlines()[-1] == "removed 2 step directories"
    assert sorted(os.listdir(root)) == ["latest", "step_0000000002"]
    rc, out, _ = _ckpt(capsys, "gc", root, "--keep", "1")
    assert rc == 0 and out == "removed 0 step directories\n"


def test_gc_usage_errors(tmp_path, capsys):
    rc, _, err = _ckpt(capsys, "gc", tmp_path / "nope", "--keep", "1")
    assert rc == 2 and "no such checkpoint root" in err
    (tmp_path / "run").mkdir()
    rc, _, err = _ckpt(capsys, "gc", tmp_path / "run", "--keep", "0")
    assert rc == 2 and "--keep must be at least 1" in err
    rc, _, err = _ckpt(capsys, "gc", tmp_path / "run")
    assert rc == 2 and "say what to keep: --keep-last N, --keep-every K and/or --keep-best" in err
    for flags, message in (
        (["--keep-last", "0"], "--keep-last must be at least 1"),
        (["--keep-every", "-3"], "--keep-every must be at least 1"),
        (["--keep", "2", "--keep-last", "2"], "--keep is --keep-last; give one of them"),
        (["--keep-best", "2:loss:median"], "KeepBest mode must be 'min' or 'max', got 'median'"),
        (["--keep-best", "two:loss"], "--keep-best wants K:METRIC[:min|max] with an integer K, got 'two:loss'"),
        (["--keep-best", "2"], "--keep-best wants K:METRIC[:min|max], got '2'"),
        (["--keep-best", "0:loss"], "KeepBest k must be a positive int, got 0"),
    ):
        rc, _, err = _ckpt(capsys, "gc", tmp_path / "run", *flags)
        assert rc == 2 and message in err, (flags, err)


def test_gc_refuses_a_locked_root_unless_forced(tmp_path, capsys):
    root = tmp_path / "run"
    _root_with_steps(root)
    (root / LOCK_NAME).write_text(json.dumps({"host": "elsewhere.example", "pid": 7, "token": "x", "created": "then"}))
    rc, out, err = _ckpt(capsys, "gc", root, "--keep", "1")
    assert rc == 1 and out == ""
    assert err.startswith(f"ckpt gc: error: {root} is locked by another writer: pid 7 on host elsewhere.example")
    assert sorted(os.listdir(root)) == [LOCK_NAME, "latest", "step_0000000001", "step_0000000002", "step_0000000003"]
    rc, out, _ = _ckpt(capsys, "gc", root, "--keep", "1", "--force")
    assert rc == 0
    assert out.splitlines()[0] == "removed the lock held by pid 7 on host elsewhere.example, since then"
    assert sorted(os.listdir(root)) == ["latest", "step_0000000002"]


def test_unlock(tmp_path, capsys):
    root = tmp_path / "run"
    _root_with_steps(root)
    assert _ckpt(capsys, "unlock", root) == (0, f"{root}: not locked\n", "")
    (root / LOCK_NAME).write_text(json.dumps({"host": "h2", "pid": 9, "token": "x", "created": "then"}))
    assert _ckpt(capsys, "unlock", root) == (0, f"{root}: removed the lock held by pid 9 on host h2, since then\n", "")
    assert not (root / LOCK_NAME).exists()
    rc, _, err = _ckpt(capsys, "unlock", tmp_path / "nope")
    assert rc == 2 and "no such checkpoint root" in err


# ---------------------------------------------------------------- help and the real process


@pytest.mark.parametrize(
    "command, phrases",
    [
        ("verify", ["Exit status: 0 intact, 1 damaged, 2 no checkpoint at URI", "CRC-32"]),
        ("inspect", ["format, step, world_size, torch_version, total_bytes, tensors", "no shard is read"]),
        ("ls", ["committed, incomplete or corrupt", "lock"]),
        (
            "gc",
            [
                "--keep",
                "--keep-last",
                "--keep-every",
                "--keep-best",
                "K:METRIC[:min|max]",
                "--dry-run",
                "--force",
                "Takes the root's lock",
                "`latest` names is always kept",
            ],
        ),
        ("unlock", ["ckptlib.lock"]),
        ("validate", ["--world-sizes"]),
        ("convert", ["--to", "--force", "one tensor at a time"]),
    ],
)
def test_help_texts(capsys, command, phrases):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for phrase in phrases:
        assert phrase in out, phrase


EXIT_STATUS = {
    "validate": "Exit status: 0 every pair passed; 1 a pair failed",
    "verify": "Exit status: 0 intact, 1 damaged, 2 no checkpoint at URI",
    "inspect": "Exit status: 0 described; 1 the manifest or .metadata is damaged or unsafe; 2 no checkpoint",
    "ls": "Exit status: 0 listed; 1 a storage error; 2 no such checkpoint root",
    "gc": "Exit status: 0 done; 1 the root is locked",
    "convert": "Exit status: 0 converted; 1 DST already holds a checkpoint (without --force)",
    "export": "Exit status: 0 exported; 1 DST exists (without --force)",
    "unlock": "Exit status: 0 removed or not locked",
}


@pytest.mark.parametrize("command", sorted(EXIT_STATUS))
def test_every_command_help_gives_its_exit_status(capsys, command):
    """Each `ckpt COMMAND --help` keeps its paragraphs (the layout argparse would flatten) and
    ends its description with the exit status; no option name is broken across lines."""
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert EXIT_STATUS[command] in " ".join(out.split())
    description = out.split("\n\n")[1:-1]
    assert len(description) >= 2, out
    assert not [line for line in out.splitlines() if line.rstrip().endswith("--keep-") or line.endswith("-")]


def test_validate_pairs_help_says_what_each_choice_runs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "every (layout, world size) saved and loaded at every other (all, default), or one case per "
        "(save layout, load layout) pair with world sizes rotated (covering)"
    ) in out


def test_top_level_help_gives_uris_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "s3://bucket/prefix, gs://bucket/prefix or az://container/prefix" in out
    assert "Exit status: 0 success; 1 a check failed" in out and "130 interrupted" in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for command in ("validate", "verify", "inspect", "ls", "gc", "unlock", "convert", "export", "bench"):
        assert f"    {command}" in out


def test_real_process_exit_code_and_no_traceback(tmp_path):
    """One real `python -m ckptlib.cli` run (a torch import costs seconds here; the rest run in-process)."""
    path = tmp_path / "c"
    ckptlib.save(path, {"w": torch.arange(100.0)})
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[-200] ^= 0xFF
    (path / "__0_0.distcp").write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(ckptlib.__file__)))}
    done = subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", "verify", str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1 and done.stderr == ""
    assert re.search(
        re.escape(f"{path}/__0_0.distcp (rank 0's shard): checksum mismatch in ") + r"(tensor|object) '", done.stdout
    )
    assert done.stdout.splitlines()[-1] == f"{path}: DAMAGED, 1 problem"


# ---------------------------------------------------------------- convert


def test_convert_torch_save_to_dcp_then_refuse_overwrite(tmp_path, capsys):
    src = os.path.join(FIXTURES, "torch_save", "checkpoint.pt")
    dst = tmp_path / "converted"
    rc, out, _ = _ckpt(capsys, "convert", src, dst, "--no-progress")
    assert rc == 0 and out.startswith(f"converted {src} (torch_save) -> {dst} (dcp): ")
    reference = torch.load(os.path.join(FIXTURES, "torch_save", "reference.pt"), weights_only=True)
    loaded = {k: torch.zeros_like(v) for k, v in reference["model"].items()}
    ckptlib.load(dst, {"model": loaded})
    assert all(torch.equal(loaded[k], v) for k, v in reference["model"].items())
    rc, _, err = _ckpt(capsys, "convert", src, dst, "--no-progress")
    assert rc == 1 and "exists" in err and str(dst) in err
    assert _ckpt(capsys, "convert", src, dst, "--no-progress", "--force")[0] == 0


def test_convert_missing_source_is_exit_2(tmp_path, capsys):
    rc, _, err = _ckpt(capsys, "convert", tmp_path / "nope", tmp_path / "out")
    assert rc == 2 and err == f"ckpt convert: error: no checkpoint at {tmp_path / 'nope'}: the path does not exist\n"
