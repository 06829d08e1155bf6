"""A checkpoint ckptlib saves under one torch minor loads bit-exactly under every other.

Two sources of checkpoints from other minors:

- committed golden ones, `tests/fixtures/ckptlib_torch<minor>/` (written by
  `generate.py --only ckptlib_dtensor` under that torch), which every run loads;
- the shared cross-version directory `$CKPTLIB_CROSS_VERSION_DIR` (tox sets it to
  `ci/compat/cross-version/`): each tox env writes `torch<minor>/` there
  (`test_write_for_other_minors`) and loads every other minor's found there.
  `ci/torch_matrix.sh` runs the suite newest first (each older minor loads every newer one),
  then this module alone oldest first (each newer minor loads every older one): every pair,
  both directions.

Each is loaded at 2 ranks (as saved) and 3 (resharded) and compared with its reference.pt.
Where this torch cannot load one, ckptlib must raise UnsupportedError naming the feature.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid

import pytest
import torch
from helpers.golden import (
    FIXTURE_NAMES,
    FIXTURES,
    build_state,
    comparable,
    diff,
    expected_state,
    full_state,
    generator,
    launch_ranks,
)

import ckptlib
from ckptlib.errors import MissingKeysError, UnsupportedError

pytestmark = pytest.mark.legacy

CROSS_DIR = os.environ.get("CKPTLIB_CROSS_VERSION_DIR") or None
THIS_MINOR = "torch" + ".".join(torch.__version__.split("+")[0].split(".")[:2])
SAVE_WS = 2


def _sources() -> dict[str, str]:
    """id -> fixture directory (ckpt/, reference.pt, fixture.json) of every other minor's checkpoint."""
    found = {
        f"golden-{n.removeprefix('ckptlib_')}": os.path.join(FIXTURES, n)
        for n in FIXTURE_NAMES
        if n.startswith("ckptlib_torch")
    }
    if CROSS_DIR and os.path.isdir(CROSS_DIR):
        for entry in sorted(os.listdir(CROSS_DIR)):
            path = os.path.join(CROSS_DIR, entry)
            if entry.startswith("torch") and entry != THIS_MINOR and os.path.isfile(os.path.join(path, "fixture.json")):
                found[f"shared-{entry}"] = path
    return found


SOURCES = _sources()


@functools.lru_cache(maxsize=None)
def _reference(directory: str) -> dict:
    return torch.load(os.path.join(directory, "reference.pt"), weights_only=True)


def _info(directory: str) -> dict:
    with open(os.path.join(directory, "fixture.json")) as f:
        return json.load(f)


def rank_load_dir(directory: str) -> dict:
    """On every rank: load the checkpoint in `directory` into a fresh state, return what differs."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    ref = _reference(directory)
    state = build_state(ref, world)
    try:
        result = ckptlib.load(os.path.join(directory, _info(directory)["checkpoint"]), state)
    except UnsupportedError as exc:
        return {"unsupported": str(exc)}
    except ckptlib.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    expected, got = comparable(expected_state(ref, state), full_state(state))
    return {
        "diffs": diff(got, expected),
        "format": result.format,
        "world_size": result.world_size,
        "missing": result.missing_keys,
    }


def rank_write(ckpt: str, out: str) -> None:
    import torch.distributed as dist

    generator().ckptlib_dtensor_rank(dist.get_rank(), dist.get_world_size(), ckpt, out)


def _write(target: str) -> None:
    """Write this minor's checkpoint into `target` (replacing an older one only when complete)."""
    staging = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(staging)
    try:
        launch_ranks(SAVE_WS, rank_write, os.path.join(staging, "ckpt"), staging)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _assert_loaded(results: list, what: str) -> None:
    unsupported = [r["unsupported"] for r in results if "unsupported" in r]
    if unsupported:
        # Allowed only as an UnsupportedError that says which feature this torch lacks.
        assert "torch" in unsupported[0] and len(unsupported) == len(results), unsupported
        pytest.skip(f"{what}: unsupported under torch {torch.__version__}: {unsupported[0]}")
    errors = [r for r in results if "error" in r]
    assert not errors, (what, errors[0])
    for rank, r in enumerate(results):
        assert r["diffs"] == [], f"{what}, rank {rank}: {r['diffs'][:10]}"
        assert r["missing"] == [] and r["format"] == "ckptlib" and r["world_size"] == SAVE_WS


def test_write_for_other_minors(tmp_path):
    """This minor's checkpoint, written where the other minors' runs look for it (or, outside
    tox, into a temporary directory), then loaded back here at 3 ranks."""
    target = os.path.join(CROSS_DIR, THIS_MINOR) if CROSS_DIR else str(tmp_path / THIS_MINOR)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    _write(target)
    info = _info(target)
    assert info["torch_version"] == torch.__version__ and info["saved_world_size"] == SAVE_WS
    assert json.load(open(os.path.join(target, "ckpt", "ckptlib.json")))["torch_version"] == torch.__version__
    _assert_loaded(launch_ranks(3, rank_load_dir, target), f"{THIS_MINOR} itself")


@pytest.mark.parametrize("world_size", [SAVE_WS, 3], ids=lambda w: f"load-ws{w}")
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_load_checkpoint_from_other_minor(source, world_size):
    directory = SOURCES[source]
    _assert_loaded(
        launch_ranks(world_size, rank_load_dir, directory), f"{source} ({_info(directory)['torch_version']})"
    )


def test_golden_checkpoints_from_several_minors():
    """The plain suite (torch 2.13 in CI) loads ckptlib checkpoints from older and newer minors."""
    minors = {s.removeprefix("golden-") for s in SOURCES if s.startswith("golden-")}
    assert {"torch2.13", "torch2.14"} <= minors, minors


# --------------------------------------------------------------------------- what differs between minors


def _adam_checkpoint(path: str, drop: tuple = ()) -> tuple:
    """ckptlib checkpoint of a trained model + Adam whose param groups lack `drop` (as one
    written by a torch whose Adam had no such hyperparameter)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    gen = generator()
    model = gen.build_model()
    optim = gen.make_optim(model)
    gen.train(model, optim)
    osd = get_optimizer_state_dict(model, optim)
    osd["param_groups"] = [{k: v for k, v in g.items() if k not in drop} for g in osd["param_groups"]]
    ckptlib.save(path, {"model": get_model_state_dict(model), "optim": osd})
    return model, optim


def test_hyperparameter_a_newer_torch_added_keeps_the_optimizers_value(tmp_path):
    """torch 2.6's Adam has no `decoupled_weight_decay`; a later torch's Adam asks for it.
    The load keeps the optimizer's own value and says so; every saved value is loaded."""
    gen = generator()
    probe = gen.make_optim(gen.build_model()).param_groups[0]
    absent = "decoupled_weight_decay" if "decoupled_weight_decay" in probe else "maximize"
    path = str(tmp_path / "old")
    saved_model, saved_optim = _adam_checkpoint(path, drop=(absent,))
    model = gen.build_model()
    optim = gen.make_optim(model)
    optim.param_groups[0]["lr"] = 0.5
    own = optim.param_groups[0][absent]
    result = ckptlib.load(path, {"model": model, "optim": optim})
    assert result.missing_keys == []
    assert any(absent in note and "keep their own values" in note for note in result.notes), result.notes
    assert optim.param_groups[0][absent] == own
    assert optim.param_groups[0]["lr"] == saved_optim.param_groups[0]["lr"]
    assert diff(dict(optim.state_dict()["state"]), dict(saved_optim.state_dict()["state"])) == []
    assert diff(model.state_dict(), saved_model.state_dict()) == []


def test_a_param_group_without_its_params_is_missing(tmp_path):
    """Only hyperparameters are kept when absent: a param group saved without its `params`
    list is a checkpoint that cannot say which parameters the group holds."""
    gen = generator()
    path = str(tmp_path / "no-params")
    _adam_checkpoint(path, drop=("params",))
    model = gen.build_model()
    with pytest.raises(MissingKeysError) as err:
        ckptlib.load(path, {"model": model, "optim": gen.make_optim(model)})
    assert str(err.value) == f"{path} lacks keys the state asks for: optim.param_groups.0.params"


def test_optimizer_the_checkpoint_lacks_is_still_missing(tmp_path):
    """Keeping absent hyperparameters never hides a whole missing optimizer (one that has not
    stepped asks only for its param groups)."""
    gen = generator()
    model = gen.build_model()
    path = str(tmp_path / "model-only")
    ckptlib.save(path, {"model": model})
    fresh = gen.build_model()
    with pytest.raises(MissingKeysError, match=r"lacks keys the state asks for: optim\.param_groups") as err:
        ckptlib.load(path, {"model": fresh, "optim": gen.make_optim(fresh)})
    assert "optim.state.embed.weight.exp_avg" in str(err.value)
