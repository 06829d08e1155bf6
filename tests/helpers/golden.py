"""The golden fixtures of tests/fixtures/ (made by tests/fixtures/generate.py): where they are,
their references, and loading one into a freshly built, differently initialised, sharded state
on every rank, compared bit for bit (shared by test_legacy, test_cross_version and
test_torch_fixtures)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys

import torch

import ckptlib
from ckptlib._torch import parallel
from ckptlib.testing import launch

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
FIXTURE_NAMES = sorted(
    name for name in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, name, "fixture.json"))
)


def fixture_info(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "fixture.json")) as f:
        return json.load(f)


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name, fixture_info(name)["checkpoint"])


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    return torch.load(os.path.join(FIXTURES, name, "reference.pt"), weights_only=True)


@functools.lru_cache(maxsize=None)
def generator():
    """tests/fixtures/generate.py as a module (FixtureModel, make_optim)."""
    spec = importlib.util.spec_from_file_location("ckptlib_fixture_generate", os.path.join(FIXTURES, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- comparing


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def diff(actual, expected, path: str = "") -> list[str]:
    """Every difference between two nested states; tensors must match dtype, shape and bits."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{path}: {type(actual).__name__}, expected a dict"]
        out = [f"{path}.{k}: missing" for k in expected if k not in actual]
        out += [f"{path}.{k}: unexpected" for k in actual if k not in expected]
        for k in expected:
            if k in actual:
                out += diff(actual[k], expected[k], f"{path}.{k}")
        return out
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            return [f"{path}: {actual!r} != {expected!r}"]
        return [d for i, (a, e) in enumerate(zip(actual, expected)) for d in diff(a, e, f"{path}.{i}")]
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: {type(actual).__name__}, expected a tensor"]
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return [f"{path}: {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} {tuple(expected.shape)}"]
        return [] if torch.equal(_bits(actual), _bits(expected)) else [f"{path}: values differ"]
    return [] if actual == expected else [f"{path}: {actual!r} != {expected!r}"]


# --------------------------------------------------------------------------- loading in ranks


def build_state(ref: dict, world_size: int, seed: int = 99) -> dict:
    """A state shaped like the fixture's, initialised differently, sharded when world_size > 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = generator()
    torch.manual_seed(seed)
    state: dict = {}
    mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 and dist.is_initialized() else None
    if "model" in ref:
        model = gen.FixtureModel()
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-7, 7)
            model.counter.fill_(-1)
        if mesh is not None and parallel.fsdp2_cpu_reason() is None:
            fully_shard = parallel.fully_shard_fn()
            for layer in (model.embed, model.proj, model.norm, model.head):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        state["model"] = model
        if "optim" in ref:
            state["optim"] = gen.make_optim(model)
    if "extra" in ref:
        state["extra"] = {}
        for k, v in ref["extra"].items():
            wrong = torch.full_like(v, 3)
            state["extra"][k] = distribute_tensor(wrong, mesh, [Shard(0)]) if mesh is not None and v.dim() else wrong
    if "meta" in ref:
        state["meta"] = {"epoch": -1, "tag": "wrong"}
    return state


def full_state(state: dict) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    out: dict = {}
    if "model" in state:
        out["model"] = get_model_state_dict(state["model"], options=opts)
    if "optim" in state:
        out["optim"] = get_optimizer_state_dict(state["model"], state["optim"], options=opts)
    if "extra" in state:
        out["extra"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state["extra"].items()}
    if "meta" in state:
        out["meta"] = dict(state["meta"])
    return out


def expected_state(ref: dict, state_keys) -> dict:
    """The reference restricted to what the state can hold (a model ignores extra tensors)."""
    gen = generator()
    out = {k: v for k, v in ref.items() if k in state_keys}
    if "model" in out:
        keys = set(gen.FixtureModel().state_dict())
        out["model"] = {k: v for k, v in out["model"].items() if k in keys}
    return out


def comparable(expected: dict, got: dict) -> tuple[dict, dict]:
    """Optimizer hyperparameters compared on the names both sides have: a fixture from a newer
    torch carries e.g. AdamW's `decoupled_weight_decay`, which torch 2.6 lacks (ckptlib does not
    load a hyperparameter the optimizer lacks), and an optimizer from a newer torch fills in
    defaults for names an older torch (1.13) never saved. Every value both have must match."""
    groups_exp = expected.get("optim", {}).get("param_groups")
    groups_got = got.get("optim", {}).get("param_groups")
    if not groups_exp or not groups_got or len(groups_exp) != len(groups_got):
        return expected, got
    common = [set(ge) & set(ga) for ge, ga in zip(groups_exp, groups_got)]
    trim = lambda groups: [{k: v for k, v in g.items() if k in keys} for g, keys in zip(groups, common)]  # noqa: E731
    return (
        {**expected, "optim": {**expected["optim"], "param_groups": trim(groups_exp)}},
        {**got, "optim": {**got["optim"], "param_groups": trim(groups_got)}},
    )


def rank_load_and_compare(name: str, path: str | None = None, drop: tuple = ()) -> dict:
    """Runs on every rank: build the state, load the fixture (or `path`), return what differs."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    ref = {k: v for k, v in reference(name).items() if k not in drop}
    state = build_state(ref, world)
    try:
        result = ckptlib.load(path or fixture_path(name), state)
    except ckptlib.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    expected, got = comparable(expected_state(ref, state), full_state(state))
    return {
        "diffs": diff(got, expected),
        "format": result.format,
        "world_size": result.world_size,
        "missing": result.missing_keys,
    }


def launch_ranks(world_size: int, fn, *args):
    return launch(world_size, fn, *args, timeout=240)


def check_ranks(results: list, name: str) -> None:
    errors = [r for r in results if "error" in r]
    assert not errors, (name, errors[0])
    for rank, r in enumerate(results):
        assert r["diffs"] == [], f"rank {rank}: {r['diffs'][:10]}"
