"""`ckpt diff` compares values, not how each torch era keyed them: one state saved as torch 1.13
did (flat dotted keys, every non-tensor value and every dict it was handed pickled whole), as
torch 2.0-2.3 did (a nested value holding no tensor pickled whole, its nesting recorded), as
torch 2.4+ does (every nested value its own key), by ckptlib and by torch.save is EQUAL to
each of the others and to its `ckpt convert` output in every target, and one changed element
or one changed hyper-parameter is DIFFERENT and named by its current (2.4+) key.

Before: diff compared the keys as stored, so `meta` (one pickled dict) against `meta.epoch` /
`meta.tag` was "only in A" / "only in B" and every converted pre-2.4 checkpoint was
DIFFERENT from its source.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import ckptlib
from ckptlib import cli
from ckptlib._torch import dcp_shims
from ckptlib.offline.diff import diff_checkpoints


def _state(epoch: int = 3, flip: bool = False, wide: bool = False) -> dict:
    w = torch.arange(12.0).reshape(4, 3)
    if flip:
        w[2, 1] = 7.5
    return {
        "model": {"w": w, "b": torch.tensor([1, 2, 3], dtype=torch.int64)},
        "optim": {
            "state": {
                "w": {"step": torch.tensor(5.0), "exp_avg": torch.ones(4, 3, dtype=torch.float64 if wide else None)}
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}],
        },
        "meta": {"epoch": epoch, "tag": "golden", "sched": {"milestones": [2, 4]}},
    }


def _flat_113(tree: dict, prefix: str = "") -> dict:
    """What a torch 1.13 user handed `save_state_dict`: dotted keys down to each tensor; a value
    without a tensor (a dict, a list) stays one value (pickled whole)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and any(isinstance(v, (dict, torch.Tensor)) for v in value.values()):
            holds_tensor = any(isinstance(v, torch.Tensor) for v in _leaves(value))
            if holds_tensor:
                out.update(_flat_113(value, name + "."))
                continue
        out[name] = value
    return out


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def _plain_dcp(path: str, state: dict, *, flatten: bool, pre_24: bool = False) -> None:
    previous = _version._derived_version
    if pre_24:
        _version._derived_version = "2_3"  # DCP's own switch to its pre-2.4 key rules
    try:
        with dcp_shims.quiet_single_process():
            dcp.save(state, checkpoint_id=path, planner=DefaultSavePlanner(flatten_state_dict=flatten), no_dist=True)
    finally:
        _version._derived_version = previous


def write(kind: str, path: str, **kw) -> str:
    """The state of `_state(**kw)` saved the way `kind` names; returns what to diff."""
    state = _state(**kw)
    if kind == "torch1.13-flat":
        _plain_dcp(path, _flat_113(state), flatten=False)
    elif kind == "torch1.13-object-holding-a-tensor":  # 1.13 pickled a whole dict, its tensor inside
        flat = _flat_113(state)
        flat["optim.state"] = {"w": {k: flat.pop(f"optim.state.w.{k}") for k in ("step", "exp_avg")}}
        _plain_dcp(path, flat, flatten=False)
    elif kind == "torch2.0-whole-objects":
        _plain_dcp(path, state, flatten=True, pre_24=True)
    elif kind == "torch2.4-flattened":
        _plain_dcp(path, state, flatten=True)
    elif kind == "ckptlib":
        ckptlib.save(path, state)
    elif kind == "torch_save":
        path += ".pt"
        torch.save(state, path)
    return path


KINDS = [
    "torch1.13-flat",
    "torch1.13-object-holding-a-tensor",
    "torch2.0-whole-objects",
    "torch2.4-flattened",
    "ckptlib",
    "torch_save",
]
EXP_AVG = "optim.state.w.exp_avg"
TENSORS = ["model.w", "model.b", "optim.state.w.step", "optim.state.w.exp_avg"]
OBJECTS = [
    "optim.param_groups.0.lr",
    "optim.param_groups.0.betas",
    "optim.param_groups.0.params",
    "meta.epoch",
    "meta.tag",
    "meta.sched.milestones",
]


def test_the_kinds_store_different_keys(tmp_path):
    """What makes this module a test: the stored keys of the kinds differ."""
    from ckptlib.format.source import inspect_checkpoint

    stored = {}
    for kind in KINDS[:4]:
        info = inspect_checkpoint(write(kind, str(tmp_path / kind)))
        stored[kind] = sorted(info.metadata.state_dict_metadata)
    assert "meta" in stored["torch1.13-flat"] and "optim.param_groups" in stored["torch1.13-flat"]
    assert "meta" in stored["torch2.0-whole-objects"] and "meta.epoch" not in stored["torch2.0-whole-objects"]
    assert "optim.state" in stored["torch1.13-object-holding-a-tensor"]
    assert sorted(TENSORS + OBJECTS) == stored["torch2.4-flattened"]


@pytest.mark.parametrize("b_kind", KINDS)
@pytest.mark.parametrize("a_kind", KINDS)
def test_every_key_shape_equals_every_other(a_kind, b_kind, tmp_path):
    a = write(a_kind, str(tmp_path / "a"))
    b = write(b_kind, str(tmp_path / "b"))
    report = diff_checkpoints(a, b)
    assert (report.only_in_a, report.only_in_b, report.mismatched) == ([], [], [])
    assert sorted(t.key for t in report.tensors) == sorted(TENSORS)
    assert all(t.bit_identical and t.within_tolerance for t in report.tensors)
    assert sorted(o["key"] for o in report.objects) == sorted(OBJECTS)
    assert all(o["equal"] for o in report.objects), report.objects
    assert report.equal


@pytest.mark.parametrize("b_kind", ["torch2.4-flattened", "torch_save"])
@pytest.mark.parametrize("a_kind", KINDS)
def test_one_change_is_different_and_named(a_kind, b_kind, tmp_path, capsys):
    """A changed element of a tensor and a changed value inside a whole-pickled dict: each is
    DIFFERENT, named by its current key, both ways round; nothing else is reported."""
    a = write(a_kind, str(tmp_path / "a"))
    for change, key in (({"flip": True}, "model.w"), ({"epoch": 4}, "meta.epoch"), ({"wide": True}, EXP_AVG)):
        b = write(b_kind, str(tmp_path / f"b-{key}"), **change)
        for x, y in ((a, b), (b, a)):
            report = diff_checkpoints(x, y)
            assert not report.equal
            assert (report.only_in_a, report.only_in_b, report.mismatched) == ([], [], [])
            differing = [t.key for t in report.tensors if not t.within_tolerance]
            differing += [o["key"] for o in report.objects if not o["equal"]]
            assert differing == [key]
        rc = cli.main(["diff", a, b, "--no-progress"])
        out = capsys.readouterr().out
        assert rc == 1 and out.splitlines()[-1] == "DIFFERENT"
        if key == "meta.epoch":
            assert "differs: meta.epoch: 3 vs 4" in out.splitlines()
        elif key == EXP_AVG:  # a dtype differs, even where torch 1.13 pickled the tensor inside a dict
            assert f"differs: {EXP_AVG}: dtype torch.float32 vs torch.float64; 0 of 12 elements beyond tolerance" in out
        else:
            assert "differs: model.w: 1 of 12 elements beyond tolerance; max abs diff 0.5 at [2, 1] (A 7.0, B 7.5)" in (
                out
            )


@pytest.mark.parametrize("to", ["dcp", "torch", "safetensors"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_conversion_equals_its_source(kind, to, tmp_path, capsys):
    src = write(kind, str(tmp_path / "src"))
    dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    assert cli.main(["convert", src, dst, "--to", to, "--no-progress"]) == 0, capsys.readouterr()
    capsys.readouterr()
    only = ["--only", "model"] if to == "safetensors" else []  # safetensors holds the model alone
    rc = cli.main(["diff", src, dst, "--no-progress", *only])
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines()[-1] == "EQUAL", out
    objects = 0 if only else len(OBJECTS)
    tensors = 2 if only else len(TENSORS)
    assert (
        f"{tensors} tensors compared: {tensors} bit-identical, 0 equal within atol=0 rtol=0, 0 different; 0 "
        f"shape/kind mismatches; 0 keys only in A, 0 only in B; {objects} other entries, 0 different"
    ) in out
    assert os.path.exists(dst)


def test_entries_that_would_share_a_key_today(tmp_path, capsys):
    """torch 1.13 stored a whole dict `a` = {"b": 1} beside a flat key `a.b`: today both are
    `a.b`. diff compares such a checkpoint by its stored keys; convert refuses with a StateError
    naming the checkpoint and the key (before: a bare ValueError from deep inside DCP)."""
    path = str(tmp_path / "clash")
    _plain_dcp(path, {"a": {"b": 1}, "a.b": torch.ones(2)}, flatten=False)
    report = diff_checkpoints(path, path)
    assert report.equal and [t.key for t in report.tensors] == ["a.b"] and report.objects[0]["key"] == "a"
    rc = cli.main(["convert", path, str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0
    assert err == (
        f"ckpt convert: error: {path}: two entries have one key under this torch's rules: duplicated flatten key a.b\n"
    )


class UsersConfig:
    """A user's class: unpickling it needs `trusted`."""

    def __init__(self, lr: float):
        self.lr = lr


@pytest.mark.parametrize("kind", ["torch2.0-whole-objects", "torch2.4-flattened", "ckptlib"])
def test_only_reads_no_other_entry(kind, tmp_path, capsys):
    """`--only model` compares the model without unpickling other entries (a user's class in
    `extra` needs --trusted); without --only that entry is refused as before, naming it."""
    paths = []
    for name, flip in (("a", False), ("b", True)):
        state = {**_state(flip=flip), "extra": {"config": UsersConfig(0.1)}}
        path = str(tmp_path / name)
        if kind == "ckptlib":
            ckptlib.save(path, state)
        else:
            _plain_dcp(path, state, flatten=True, pre_24=kind.startswith("torch2.0"))
        paths.append(path)
    rc = cli.main(["diff", *paths, "--only", "model", "--no-progress"])
    out, err = capsys.readouterr()
    assert (rc, out.splitlines()[-1], err) == (1, "DIFFERENT", "")
    assert [line.split(":")[1] for line in out.splitlines() if line.startswith("differs")] == [" model.w"]
    assert "2 tensors compared: 1 bit-identical" in out
    rc = cli.main(["diff", *paths, "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2 and "UsersConfig" in err and err.startswith("ckpt diff: error: ")
