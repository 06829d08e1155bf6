"""Every `ckpt` command that reports takes `--json`, and then prints one JSON document on stdout
and nothing else (no "using step N" note, no table), with the same exit status as its text.

Before: verify, gc, convert, export and unlock had no --json (a script had to parse their text).
Commands are run in-process (`ckptlib.cli.main`), one root of two steps per module.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

import ckptlib
from ckptlib.cli import main
from ckptlib.cli.parser import build_parser

REPORTING = ["ls", "inspect", "verify", "plan", "diff", "gc", "convert", "export", "unlock", "validate"]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def run_json(argv: list[str], code: int = 0) -> dict:
    got, out, err = run(argv + ["--json"])
    assert got == code, (got, out, err)
    return json.loads(out)  # the whole of stdout is one document


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("json") / "root")
    mgr = ckptlib.CheckpointManager(path)
    for step in (1, 2):
        mgr.save(step, {"model": {"w": torch.arange(6.0) * step, "b": torch.ones(2)}, "epoch": step})
    mgr.close()
    return path


def test_every_reporting_command_offers_json():
    commands = build_parser()._subparsers._group_actions[0].choices
    offered = {name: any("--json" in a.option_strings for a in commands[name]._actions) for name in REPORTING}
    assert offered == {name: True for name in REPORTING}


def test_verify_json_intact_then_damaged(root, tmp_path):
    doc = run_json(["verify", root, "--no-progress"])
    step2 = os.path.join(root, "step_0000000002")
    assert doc["checkpoint"] == step2 and doc["format"] == "ckptlib" and doc["intact"] is True
    assert [p["kind"] for p in doc["problems"]] == []
    assert doc["root"] == {"uri": root, "step": 2, "chosen": "latest", "warning": None}

    damaged = tmp_path / "damaged"
    ckptlib.save(str(damaged), {"model": {"w": torch.arange(4.0)}})
    shard = next(n for n in os.listdir(damaged) if n.endswith(".distcp"))
    with open(damaged / shard, "r+b") as f:
        f.seek(os.path.getsize(damaged / shard) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0xFF]))
    doc = run_json(["verify", str(damaged), "--no-progress"], code=1)
    assert doc["intact"] is False and doc["root"] is None
    assert {p["file"] for p in doc["problems"] if p["kind"] != "note"} == {shard}


def test_gc_json_reports_what_it_removes(root, tmp_path):
    import shutil

    copy = str(tmp_path / "root")
    shutil.copytree(root, copy, symlinks=True)
    assert run_json(["gc", copy, "--keep-last", "1", "--dry-run", "--no-progress"]) == {
        "root": copy,
        "dry_run": True,
        "removed": ["step_0000000001"],
        "lock_removed": None,
    }
    assert sorted(os.listdir(copy)) == ["latest", "step_0000000001", "step_0000000002"]
    doc = run_json(["gc", copy, "--keep-last", "1", "--no-progress"])
    assert doc["removed"] == ["step_0000000001"] and doc["dry_run"] is False
    assert sorted(os.listdir(copy)) == ["latest", "step_0000000002"]


def test_unlock_json(root):
    assert run_json(["unlock", root]) == {"root": root, "removed": None}


def test_convert_and_export_json(root, tmp_path):
    dst = str(tmp_path / "torch.pt")
    doc = run_json(["convert", root, dst, "--to", "torch", "--no-progress"])
    assert (doc["src"], doc["dst"], doc["src_format"], doc["to"]) == (
        os.path.join(root, "step_0000000002"),
        dst,
        "ckptlib",
        "torch",
    )
    assert (doc["tensors"], doc["objects"], doc["tensor_bytes"]) == (2, 1, 8 * 4)
    assert torch.load(dst)["model"]["w"].equal(torch.arange(6.0) * 2)

    out = str(tmp_path / "hf")
    doc = run_json(["export", root, out, "--model-only", "--no-progress"])
    assert (doc["step"], doc["tensors"], doc["bytes"], doc["format"]) == (2, 2, 8 * 4, "safetensors")
    assert doc["files"] == ["model.safetensors"]


def test_text_output_is_unchanged_without_json(root):
    code, out, _ = run(["verify", root, "--no-progress"])
    assert code == 0
    assert out.splitlines()[-1] == f"{os.path.join(root, 'step_0000000002')}: OK"
    assert out.splitlines()[0].startswith(f"checkpoint root {root}: using step 2")
