"""GPU: NCCL save/load at world sizes up to the GPU count, CUDA tensors, and checkpoints
moving between GPU (NCCL) and CPU (gloo) ranks in both directions across world sizes.

Every test is marked `gpu`: without CUDA, NCCL or enough GPUs it is skipped with the reason
(the plugin checks before the test runs; `dist_run(..., backend="nccl")` raises a skip for
world sizes above the GPU count), and collection never touches CUDA. A GPU runner runs
`ci/gpu.sh` (pytest -m gpu --backend nccl); see docs/gpu.md.

Comparisons: the state after a load must equal the saved state bit for bit (a load is a
copy). One training step after the load is compared with a run that reached the same state
without a checkpoint, on the same devices and world size, with deterministic algorithms
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG); that too must be exact.
"""

from __future__ import annotations

import pytest

from ckptlib._torch import parallel
from ckptlib.errors import UnsupportedError
from ckptlib.testing import gpu_skip_reason
from ckptlib.testing.matrices import matrix as mx

pytestmark = pytest.mark.gpu

WORLD_SIZES = (1, 2, 4, 8)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def need_gpus(n: int) -> None:
    reason = gpu_skip_reason(n, "nccl")
    if reason:
        pytest.skip(f"gpu test: {reason}")


def cpu_wrap() -> str:
    return "fsdp2" if parallel.fsdp2_cpu_reason() is None else "ddp"


# --------------------------------------------------------------------------- rank bodies


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device())


def gpu_setup(wrap: str, optim: str, seed: int):
    """The matrix model on this rank's GPU: FSDP2 over a CUDA mesh, DDP, or plain."""
    import torch
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    model = mx.build_model(seed).to(_device())
    if wrap == "fsdp2":
        fully_shard = parallel.fully_shard_fn()
        if fully_shard is None:
            raise UnsupportedError(f"torch {torch.__version__} has no FSDP2")
        mesh = parallel.init_device_mesh_fn()("cuda", (dist.get_world_size(),))
        for layer in (model.inp, model.norm, model.out):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    elif wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[_device().index])
    return model, mx.make_optimizer(optim, model.parameters())


def gpu_train_step(model, optim, step: int) -> None:
    loss = model(mx.batch(step).to(_device())).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def gpu_save(uri: str, wrap: str, optim: str, steps: int = 2) -> dict:
    """Train on GPUs, save through CheckpointManager; return the full state (on CPU)."""
    import ckptlib

    model, opt = gpu_setup(wrap, optim, seed=0)
    for step in range(steps):
        gpu_train_step(model, opt, step)
    ckptlib.CheckpointManager(uri).save(steps, {"model": model, "optim": opt, "step": steps})
    return mx.full_state(model, opt)


def gpu_load(uri: str, wrap: str, optim: str, expected: dict, steps: int = 2) -> list[str]:
    """Load on GPUs, compare with `expected`, then train one step against a reference."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import ckptlib

    model, opt = gpu_setup(wrap, optim, seed=1)
    state = {"model": model, "optim": opt, "step": -1}
    loaded = ckptlib.CheckpointManager(uri).load(state)
    problems = (
        [] if loaded == steps and state["step"] == steps else [f"step {loaded}/{state['step']}, expected {steps}"]
    )
    problems += mx.differences(expected, mx.full_state(model, opt), "after-load")
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type != "cuda":
            problems.append(f"{name}: loaded onto {local.device}, expected cuda")
    gpu_train_step(model, opt, steps)
    resumed = mx.full_state(model, opt)

    ref_model, ref_opt = gpu_setup(wrap, optim, seed=2)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(ref_model, expected["model"], options=options)
    set_optimizer_state_dict(ref_model, ref_opt, expected["optim"], options=options)
    gpu_train_step(ref_model, ref_opt, steps)
    problems += mx.differences(mx.full_state(ref_model, ref_opt), resumed, "train-after-load")
    return problems


def cuda_tensors_round_trip(uri: str) -> list[str]:
    """Plain CUDA tensors, a CUDA RNG and an odd-shaped bf16 tensor; loaded into CUDA and CPU."""
    import torch

    import ckptlib

    dev = _device()
    torch.cuda.manual_seed(1234)
    state = {
        "w": torch.randn(7, 5, device=dev),
        "h": torch.randn(3, device=dev, dtype=torch.bfloat16),
        "rng": ckptlib.RNGState(),
        "step": 3,
    }
    ckptlib.save(uri, state, step=3)
    after_save = torch.rand(4, device=dev)  # what the RNG gives next
    problems = []
    into_cuda = {
        "w": torch.zeros(7, 5, device=dev),
        "h": torch.zeros(3, device=dev, dtype=torch.bfloat16),
        "rng": ckptlib.RNGState(),
        "step": 0,
    }
    torch.cuda.manual_seed(999)
    ckptlib.load(uri, into_cuda)
    if not torch.equal(torch.rand(4, device=dev), after_save):
        problems.append("CUDA RNG not restored")
    into_cpu = {"w": torch.zeros(7, 5), "h": torch.zeros(3, dtype=torch.bfloat16), "step": 0}
    ckptlib.load(uri, into_cpu)
    for key in ("w", "h"):
        if into_cuda[key].device.type != "cuda":
            problems.append(f"{key}: loaded onto {into_cuda[key].device}")
        if not torch.equal(into_cuda[key], state[key]):
            problems.append(f"{key}: CUDA load differs")
        if not torch.equal(into_cpu[key], state[key].cpu()):
            problems.append(f"{key}: CPU load differs")
    if into_cuda["step"] != 3 or into_cpu["step"] != 3:
        problems.append("step not restored")
    return problems


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
@pytest.mark.parametrize("save_ws", WORLD_SIZES, ids=[f"save{n}" for n in WORLD_SIZES])
def test_nccl_save_load_every_world_size(save_ws, wrap, tmp_path, dist_run):
    """Save on N GPUs, load on every M <= the GPU count (M in 1, 2, 4, 8)."""
    need_gpus(save_ws)
    import torch

    root = str(tmp_path / "run")
    expected = dist_run(save_ws, gpu_save, root, wrap, "adamw", backend="nccl", env=DETERMINISTIC_ENV)[0]
    for load_ws in [m for m in WORLD_SIZES if m <= torch.cuda.device_count()]:
        problems = dist_run(load_ws, gpu_load, root, wrap, "adamw", expected, backend="nccl", env=DETERMINISTIC_ENV)
        assert problems == [[]] * load_ws, f"save {save_ws} -> load {load_ws}: {problems}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_tensors_and_rng(world_size, tmp_path, dist_run):
    need_gpus(world_size)
    results = dist_run(world_size, cuda_tensors_round_trip, str(tmp_path / "ck"), backend="nccl")
    assert results == [[]] * world_size


CROSS = [
    # (saved on, N, loaded on, M)
    ("cuda", 2, "cpu", 3),
    ("cuda", 4, "cpu", 1),
    ("cuda", 1, "cpu", 4),
    ("cpu", 3, "cuda", 2),
    ("cpu", 1, "cuda", 4),
    ("cpu", 4, "cuda", 1),
]


@pytest.mark.parametrize("save_dev,save_ws,load_dev,load_ws", CROSS, ids=[f"{a}{n}-to-{b}{m}" for a, n, b, m in CROSS])
def test_cross_device(save_dev, save_ws, load_dev, load_ws, tmp_path, dist_run):
    """Saved by NCCL ranks on GPUs and loaded by gloo ranks on CPU, and the reverse."""
    need_gpus(save_ws if save_dev == "cuda" else load_ws)
    root = str(tmp_path / "run")
    gpu_wrap, wrap_cpu = "fsdp2", cpu_wrap()
    if save_dev == "cuda":
        expected = dist_run(save_ws, gpu_save, root, gpu_wrap, "adamw", backend="nccl", env=DETERMINISTIC_ENV)[0]
        problems = dist_run(load_ws, mx.load_side, root, wrap_cpu, "adamw", expected, manager=True, backend="gloo")
    else:
        expected = dist_run(save_ws, mx.save_side, root, wrap_cpu, "adamw", manager=True, backend="gloo")[0]
        problems = dist_run(load_ws, gpu_load, root, gpu_wrap, "adamw", expected, backend="nccl", env=DETERMINISTIC_ENV)
    assert problems == [[]] * load_ws
