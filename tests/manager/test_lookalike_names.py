"""Names that merely start (or end) like one of ckptlib's own file names (`ckptlib.json.bak`,
`__0_0.distcp.orig`, `.metadata.old`, `x.metadata`) are the user's: an overwrite refuses to
replace a checkpoint holding one, and retention, gc, debris cleanup, convert and export leave
each one byte for byte where it was.

Catches a class of bug, not one bug: an ownership test by prefix or suffix (`startswith`,
an unanchored pattern) instead of by the exact names ckptlib writes.
"""

from __future__ import annotations

import os

import pytest
import torch

import ckptlib
from ckptlib import CheckpointManager, OverwriteRefusedError, cli
from ckptlib.format.native.deletion import is_own_file
from ckptlib.format.native.root import step_dir
from ckptlib.manager.cleanup import ForeignFilesWarning

LOOKALIKES = [
    "ckptlib.json.bak",
    "ckptlib.json~",
    "old.ckptlib.json",
    "ckptlib.pending.1",
    ".metadata.old",
    "x.metadata",
    "__0_0.distcp.orig",
    "__0_0.distcp.tmp-nothex!",
    "__0_0.distcp.tmp-0123456789",
    "___0_0.distcp",
    "__0_0.distcpx",
    ".metadata.tmp.keep",
]
OWN = ["ckptlib.json", "ckptlib.pending", ".metadata", "__0_0.distcp", "__12_3.distcp", "__0_0.distcp.tmp-0a1b2c3d"]


def _mine(name: str) -> bytes:
    return f"the user's own {name}".encode()


def _plant(directory: str, names=LOOKALIKES) -> None:
    for name in names:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(_mine(name))


def _assert_untouched(directory: str, names=LOOKALIKES) -> None:
    for name in names:
        with open(os.path.join(directory, name), "rb") as f:
            assert f.read() == _mine(name), name


def test_ownership_is_by_exact_name():
    assert [n for n in OWN if not is_own_file(n)] == []
    assert [n for n in LOOKALIKES if is_own_file(n)] == []


def test_an_overwrite_refuses_a_checkpoint_holding_a_lookalike(tmp_path):
    target = str(tmp_path / "ckpt")
    ckptlib.save(target, {"w": torch.arange(6.0)})
    _plant(target)
    with pytest.raises(OverwriteRefusedError) as info:
        ckptlib.save(target, {"w": torch.zeros(6)}, overwrite=True)
    shown = sorted(LOOKALIKES)[:8]  # the message names eight and counts the rest
    assert f"ckptlib did not write: {', '.join(shown)} ... ({len(LOOKALIKES)} in all)" in str(info.value)
    _assert_untouched(target)
    state = {"w": torch.zeros(6)}
    ckptlib.load(target, state)  # the checkpoint itself is untouched too
    assert torch.equal(state["w"], torch.arange(6.0))


def test_retention_and_gc_keep_lookalikes_in_step_directories(tmp_path, capsys):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, {"w": torch.ones(3)})
    first = os.path.join(root, step_dir(1))
    _plant(first)
    with pytest.warns(ForeignFilesWarning, match=f"{first} holds files ckptlib did not write"):
        mgr.save(2, {"w": torch.full((3,), 2.0)})  # retention removes step 1's own files only
    assert sorted(os.listdir(first)) == sorted(LOOKALIKES)
    _assert_untouched(first)
    assert mgr.steps() == [2] and mgr.latest() == 2
    assert cli.main(["gc", root, "--keep", "1"]) == 0
    capsys.readouterr()
    _assert_untouched(first)
    state = {"w": torch.zeros(3)}
    assert CheckpointManager(root).load(state) == 2 and torch.equal(state["w"], torch.full((3,), 2.0))


def test_debris_cleanup_keeps_lookalikes(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": torch.ones(3)})
    debris = os.path.join(root, step_dir(5))  # a save that crashed before its commit
    os.makedirs(debris)
    for name, data in (("ckptlib.pending", b"{}"), ("__0_0.distcp", b"half")):
        with open(os.path.join(debris, name), "wb") as f:
            f.write(data)
    _plant(debris)
    with pytest.warns(ForeignFilesWarning, match=f"{debris} holds files ckptlib did not write"):
        mgr.save(2, {"w": torch.ones(3)})  # collects debris
    assert sorted(os.listdir(debris)) == sorted(LOOKALIKES)
    _assert_untouched(debris)
    assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("how", ["convert", "export"])
def test_forced_convert_and_export_keep_lookalikes(tmp_path, how):
    pytest.importorskip("safetensors")
    src = str(tmp_path / "ckpt")
    ckptlib.save(src, {"model": {"w": torch.arange(8.0)}})
    dst = str(tmp_path / "out")
    names = (
        LOOKALIKES
        if how == "convert"
        else ["model.safetensors.bak", "model.safetensors.index.json.orig", "old-model.safetensors", "ckptlib.json.bak"]
    )
    run = (
        (lambda **kw: ckptlib.convert(src, dst, **kw))
        if how == "convert"
        else (lambda **kw: ckptlib.export(src, dst, **kw))
    )
    run()
    _plant(dst, names)
    try:
        run(force=True)
    except OverwriteRefusedError as exc:  # refusing is fine, as long as it names them and touches nothing
        assert any(name in str(exc) for name in names)
    _assert_untouched(dst, names)
