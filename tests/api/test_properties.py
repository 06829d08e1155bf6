"""Property test: random shapes, dtypes, placements and nesting; save at N, load at M; equal.

Shapes include dims smaller than the world size (zero-size shards) and dims not divisible
by it (uneven shards); the load side picks its own placements, so every example reshards.
Examples are few and derandomized so CI stays fast and repeatable.
"""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlib

pytestmark = pytest.mark.elastic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int64": torch.int64}


@st.composite
def tensor_specs(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    return {
        "shape": shape,
        "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "path": tuple(draw(st.lists(st.sampled_from(["a", "b", "c"]), max_size=2))),
        "save_placement": draw(st.sampled_from(["replicate"] + [f"shard{d}" for d in range(ndim)])),
        "load_placement": draw(st.sampled_from(["replicate", "local"] + [f"shard{d}" for d in range(ndim)])),
    }


@st.composite
def cases(draw):
    specs = draw(st.lists(tensor_specs(), min_size=1, max_size=4))
    return {
        "specs": specs,
        "save_ws": draw(st.integers(1, 4)),
        "load_ws": draw(st.integers(1, 4)),
        "seed": draw(st.integers(0, 2**16)),
    }


def full_tensor(spec: dict, index: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 101 + index)
    dtype = DTYPES[spec["dtype"]]
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, spec["shape"], generator=gen, dtype=torch.int64)
    return torch.randn(spec["shape"], generator=gen).to(dtype)


def _placed(full: torch.Tensor, placement: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if placement == "local":
        return full.clone()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    place = Replicate() if placement == "replicate" else Shard(int(placement[5:]))
    return distribute_tensor(full, mesh, [place])


def _nest(specs: list[dict], make) -> dict:
    state: dict = {}
    for i, spec in enumerate(specs):
        node = state
        for key in spec["path"]:
            node = node.setdefault(key, {})
        node[f"t{i}"] = make(i, spec)
    return state


def _save(uri: str, case: dict):
    state = _nest(case["specs"], lambda i, s: _placed(full_tensor(s, i, case["seed"]), s["save_placement"]))
    ckptlib.save(uri, {"tree": state})


def _load(uri: str, case: dict) -> list[str]:
    def empty(i, spec):
        return _placed(torch.zeros(spec["shape"], dtype=DTYPES[spec["dtype"]]), spec["load_placement"])

    state = _nest(case["specs"], empty)
    ckptlib.load(uri, {"tree": state})
    problems = []
    for i, spec in enumerate(case["specs"]):
        node = state
        for key in spec["path"]:
            node = node[key]
        value = node[f"t{i}"]
        got = value.full_tensor() if hasattr(value, "full_tensor") else value
        if not torch.equal(got, full_tensor(spec, i, case["seed"])):
            problems.append(f"t{i} {spec}")
    return problems


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases())
def test_random_states_survive_resharding(case, tmp_path, dist_run):
    uri = str(tmp_path / uuid.uuid4().hex)
    dist_run(case["save_ws"], _save, uri, case)
    problems = dist_run(case["load_ws"], _load, uri, case)
    assert problems == [[]] * case["load_ws"], case
