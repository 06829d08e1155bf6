"""Commands that take a checkpoint also take a CheckpointManager root (its `latest` step, or
`--step N`) and say which step they read; `ckpt ls` of a single checkpoint shows it; `ckpt
inspect` lists long object lists one per line.

Before: `ckpt inspect|verify ROOT` said "is not a checkpoint", `ckpt ls CHECKPOINT` printed an
empty table with exit 0, and inspect's objects were one comma-separated line (5 KB here).
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as st
import torch

import ckptlib
from ckptlib import CheckpointManager, cli
from ckptlib.cli.roots import listed_steps, resolve_checkpoint
from ckptlib.errors import CheckpointError, CheckpointNotFoundError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def _ckpt(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def _state(step: int) -> dict:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3) * step}, "epoch": step}


@pytest.fixture
def root(tmp_path):
    """A root with committed steps 3 and 5 (latest 5) and the debris of a step 7 that never committed."""
    path = tmp_path / "run"
    mgr = CheckpointManager(path)
    for step in (3, 5):
        mgr.save(step, _state(step))
    debris = path / "step_0000000007"
    debris.mkdir()
    (debris / "ckptlib.pending").write_text("{}")
    return path


def _step(root, step: int) -> str:
    return f"{root}/step_{step:010d}"


def test_inspect_and_verify_read_the_latest_step_and_say_so(root, capsys):
    rc, out, err = _ckpt(capsys, "inspect", root)
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[:4] == [
        f"checkpoint root {root}: using step 5 (its latest), {_step(root, 5)}",
        f"checkpoint:    {_step(root, 5)}",
        "format:        ckptlib",
        "step:          5",
    ]
    rc, out, err = _ckpt(capsys, "verify", root, "--no-progress")
    assert (rc, err) == (0, "")
    assert out == f"checkpoint root {root}: using step 5 (its latest), {_step(root, 5)}\n{_step(root, 5)}: OK\n"


def test_step_chooses_another_step(root, capsys):
    rc, out, _ = _ckpt(capsys, "verify", root, "--step", "3", "--no-progress")
    assert rc == 0
    assert out == f"checkpoint root {root}: using step 3 (--step), {_step(root, 3)}\n{_step(root, 3)}: OK\n"
    rc, out, err = _ckpt(capsys, "inspect", "--json", root, "--step", "3")
    assert (rc, err) == (0, "")
    doc = json.loads(out)  # no note line: the JSON says which step
    assert doc["step"] == 3 and doc["root"] == {"uri": str(root), "step": 3, "chosen": "--step", "warning": None}


def test_a_missing_step_names_the_root_and_its_committed_steps(root, capsys):
    for argv, step, why in (
        (["verify", root, "--step", "4"], 4, ""),
        (["inspect", root, "--step", "7"], 7, " (its step directory is incomplete)"),
    ):
        rc, out, err = _ckpt(capsys, *argv)
        assert (rc, out) == (2, "")
        assert err == f"ckpt {argv[0]}: error: {root} has no committed step {step}{why}; committed steps: 3, 5\n"
    with pytest.raises(CheckpointNotFoundError) as info:
        resolve_checkpoint(str(root), 4)
    assert info.value.path == str(root) and isinstance(info.value, CheckpointError)


def test_a_root_without_committed_steps_is_an_error_naming_it(tmp_path, capsys):
    path = tmp_path / "run"
    (path / "step_0000000002").mkdir(parents=True)
    (path / "step_0000000002" / "ckptlib.pending").write_text("{}")
    rc, out, err = _ckpt(capsys, "inspect", path)
    assert (rc, out) == (2, "")
    assert err == (
        f"ckpt inspect: error: {path} is a checkpoint root with no committed step "
        "(step directories that never committed: 2)\n"
    )
    rc, _, err = _ckpt(capsys, "verify", path, "--step", "2")
    assert rc == 2 and err == (
        f"ckpt verify: error: {path} has no committed step 2 (its step directory is incomplete); it has no "
        "committed step\n"
    )


def test_step_needs_a_root(tmp_path, capsys):
    ckptlib.save(tmp_path / "c", {"w": torch.ones(2)}, step=1)
    rc, out, err = _ckpt(capsys, "inspect", tmp_path / "c", "--step", "1")
    assert (rc, out) == (2, "")
    assert err == f"ckpt inspect: error: --step 1: {tmp_path / 'c'} is a checkpoint, not a checkpoint root of steps\n"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("hi")
    rc, _, err = _ckpt(capsys, "verify", tmp_path / "d", "--step", "1")
    assert rc == 2
    assert (
        err == f"ckpt verify: error: --step 1: {tmp_path / 'd'} is not a checkpoint root (it has no step directories)\n"
    )
    rc, _, err = _ckpt(capsys, "inspect", tmp_path / "d")  # no --step: the command says what is there
    assert rc == 2 and "is not a checkpoint" in err
    with pytest.raises(SystemExit):
        cli.main(["inspect", str(tmp_path / "c"), "--step", "-1"])
    assert "expected a step number (an integer >= 0), got '-1'" in capsys.readouterr().err


def test_a_stale_latest_pointer_is_noted(root, capsys):
    os.unlink(root / "latest")
    os.symlink("step_0000000009", root / "latest")
    rc, out, err = _ckpt(capsys, "verify", root, "--no-progress")
    assert (rc, err) == (0, "")
    assert out.splitlines()[:2] == [
        f"checkpoint root {root}: using step 5 (its latest), {_step(root, 5)}",
        f"note: {root}/latest points to 'step_0000000009', which is not a committed checkpoint; using step 5",
    ]


def test_convert_and_export_read_a_root(root, tmp_path, capsys):
    rc, out, err = _ckpt(capsys, "convert", root, tmp_path / "dcp", "--no-progress")
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == f"checkpoint root {root}: using step 5 (its latest), {_step(root, 5)}"
    assert "1 tensor, 1 object," in out.splitlines()[1]
    loaded = {"model": {"w": torch.zeros(4, 3)}, "epoch": 0}
    ckptlib.load(tmp_path / "dcp", loaded)
    assert torch.equal(loaded["model"]["w"], _state(5)["model"]["w"]) and loaded["epoch"] == 5
    rc, out, err = _ckpt(capsys, "export", root, tmp_path / "hf", "--step", "3", "--model-only", "--no-progress")
    assert (rc, err) == (0, "")
    assert out.splitlines()[0] == f"checkpoint root {root}: using step 3 (--step), {_step(root, 3)}"
    assert torch.equal(st.load_file(str(tmp_path / "hf" / "model.safetensors"))["w"], _state(3)["model"]["w"])
    rc, _, err = _ckpt(capsys, "export", root, tmp_path / "hf2", "--step", "4")
    assert rc == 2 and err == f"ckpt export: error: {root} has no committed step 4; committed steps: 3, 5\n"


def test_the_resolver_gives_plan_the_step_uri(root):
    """`ckpt plan` (plan_cmd) is to call it on its CKPT: the URI it plans is the step's."""
    resolved = resolve_checkpoint(str(root))
    assert (resolved.uri, resolved.root, resolved.step, resolved.chosen) == (_step(root, 5), str(root), 5, "latest")
    plain = resolve_checkpoint(_step(root, 3))
    assert (plain.uri, plain.root, plain.note()) == (_step(root, 3), None, None)


def test_many_steps_are_listed_short():
    assert listed_steps([1, 2]) == "1, 2"
    assert listed_steps(list(range(20))) == "0, 1, 2, ..., 15, 16, 17, 18, 19 (20 in all)"


# ---------------------------------------------------------------- ls of a single checkpoint


def test_ls_of_a_single_checkpoint_shows_it(tmp_path, capsys):
    path = tmp_path / "c"
    ckptlib.save(path, {"w": torch.ones(3)}, step=12)
    rc, out, err = _ckpt(capsys, "ls", "--json", path)
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    assert (doc["root"], doc["checkpoint"], doc["latest"], doc["lock"]) == (str(path), "ckptlib", None, None)
    (row,) = doc["steps"]
    size = sum(p.stat().st_size for p in path.iterdir())
    assert (row["step"], row["name"], row["state"], row["world_size"], row["bytes"], row["latest"]) == (
        12,
        ".",
        "committed",
        1,
        size,
        False,
    )
    rc, out, _ = _ckpt(capsys, "ls", path)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 3
    assert lines[0] == f"{path}: a single checkpoint (ckptlib), not a checkpoint root"
    assert lines[1].split() == ["step", "state", "world", "size", "age", "latest", "metrics"]
    assert lines[2].split()[:5] == ["12", "committed", "1", f"{size / 1024:.1f}", "KiB"]


def test_ls_of_a_plain_dcp_checkpoint_and_a_torch_save_file(tmp_path, capsys):
    dcp_path = os.path.join(FIXTURES, "dcp_dtensor_torch2.13", "ckpt")
    rc, out, _ = _ckpt(capsys, "ls", dcp_path)
    lines = out.splitlines()
    assert rc == 0 and lines[0] == f"{dcp_path}: a single checkpoint (dcp), not a checkpoint root"
    size = sum(os.path.getsize(os.path.join(dcp_path, n)) for n in os.listdir(dcp_path))
    assert lines[2].split()[:4] == ["-", "dcp", "2", f"{size / 1024:.1f}"] and len(lines) == 3
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, pt)
    rc, out, _ = _ckpt(capsys, "ls", "--json", pt)
    doc = json.loads(out)
    assert rc == 0 and doc["checkpoint"] == "torch_save"
    assert [(r["state"], r["bytes"], r["world_size"]) for r in doc["steps"]] == [
        ("torch_save", pt.stat().st_size, None)
    ]


def test_ls_of_an_empty_root_is_still_an_empty_listing(tmp_path, capsys):
    (tmp_path / "new").mkdir()
    rc, out, _ = _ckpt(capsys, "ls", tmp_path / "new")
    assert rc == 0 and out.split() == ["step", "state", "world", "size", "age", "latest", "metrics"]


# ---------------------------------------------------------------- inspect's lists


def test_inspect_lists_objects_one_per_line_and_all_of_them_in_json(tmp_path, capsys):
    objects = {f"trainer.callbacks.callback_with_a_long_name_{i:03d}": i for i in range(200)}
    ckptlib.save(tmp_path / "c", {"w": torch.ones(2), **objects})
    rc, out, _ = _ckpt(capsys, "inspect", tmp_path / "c")
    lines = out.splitlines()
    at = lines.index("objects:       200")
    assert rc == 0 and lines[at + 1 :] == [f"  {key}" for key in sorted(objects)]
    assert max(len(line) for line in lines) < 100
    rc, out, _ = _ckpt(capsys, "inspect", "--json", tmp_path / "c")
    assert rc == 0 and json.loads(out)["objects"] == sorted(objects)


def test_an_object_store_root(request, capsys):
    pytest.importorskip("boto3")
    root = request.getfixturevalue("s3_root")
    mgr = CheckpointManager(root)
    for step in (3, 5):
        mgr.save(step, _state(step))
    step5 = f"{root.rstrip('/')}/step_0000000005"
    rc, out, err = _ckpt(capsys, "verify", root, "--no-progress")
    assert (rc, err) == (0, "")
    assert out == f"checkpoint root {root}: using step 5 (its latest), {step5}\n{step5}: OK\n"
    rc, _, err = _ckpt(capsys, "inspect", root, "--step", "4")
    assert rc == 2 and err == f"ckpt inspect: error: {root} has no committed step 4; committed steps: 3, 5\n"
