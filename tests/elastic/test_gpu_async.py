"""GPU: async saves of CUDA state through the writer process's pinned shared memory (issue 35
item 4): the staging copy lands in pinned memfd segments and loads back bit-exact onto CUDA and
onto the CPU; with `background_staging=True` the device-to-host copy overlaps the next step's
forward and backward, and the checkpoint still holds exactly the state at the save; the writer
process reads a state spread over several pinned segments.

Every test is marked `gpu` and skips without CUDA, NCCL or enough GPUs with the reason, as in
test_gpu.py (collection never touches CUDA); a GPU runner runs them through `ci/gpu.sh`. The
ranks are NCCL ranks (`dist_run(..., backend="nccl")`); the CPU loads run in the test process
itself, without a process group. Comparisons are bit for bit: a checkpoint is a copy, and the
training runs with deterministic algorithms against a run that never saved.
"""

from __future__ import annotations

import pytest
import torch

import ckptlib
from ckptlib._torch import parallel
from ckptlib.errors import UnsupportedError
from ckptlib.testing import gpu_skip_reason
from ckptlib.testing.matrices import matrix as mx

pytestmark = pytest.mark.gpu

WORLD_SIZES = (1, 2)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
WIDTH, LAYERS, BATCH = 2048, 8, 2  # 16 MiB weights: 384 MiB of state to copy (AdamW), a step of little compute
SAVE_AT, STEPS = (2, 5), 8
WAIT_S = 300


def need_gpus(n: int) -> None:
    reason = gpu_skip_reason(n, "nccl")
    if reason:
        pytest.skip(f"gpu test: {reason}")


# --------------------------------------------------------------------------- rank bodies


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


_MESHES: dict = {}  # this rank's mesh, made once (a rank is a fresh process per launch)


def _mesh():
    import torch.distributed as dist

    kind = _device().type
    if kind not in _MESHES:
        _MESHES[kind] = parallel.init_device_mesh_fn()(kind, (dist.get_world_size(),))
    return _MESHES[kind]


def _sharded(local: torch.Tensor):
    """A Shard(0) DTensor over this rank's GPU mesh whose local shard is a copy of `local` on the GPU."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local.to(_device(), copy=True), _mesh(), [Shard(0)], run_check=False)


def _locals(seed: int, rows: int) -> dict[str, torch.Tensor]:
    """This rank's shards (CPU): float32 with an odd width, bfloat16, int64; a different seed a rank."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(seed + 100 * dist.get_rank())
    return {
        "w": torch.randn(rows, 257, generator=gen),
        "h": torch.randn(rows, 3, generator=gen).to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (rows, 5), generator=gen),
    }


def staging_problems() -> list[str]:
    """What is wrong with this rank's writer process staging: no writer or no segment, a segment
    not pinned, tensor bytes sent through the socket instead of read from shared memory."""
    from ckptlib.saving import writer_process

    writer = writer_process.current()
    if writer is None:
        return ["no writer process was started"]
    segments = list(writer.arena.segments.values())
    found = [] if segments else ["the staging arena holds no segment"]
    found += [f"staging segment {s.id} ({s.size} bytes) is not pinned" for s in segments if not s.pinned]
    if writer.bytes_sent_whole:
        found.append(f"{writer.bytes_sent_whole} tensor bytes went through the socket, not shared memory")
    return found


def _release() -> None:
    from ckptlib.saving import background_save

    background_save.release_staging()


def _cuda_round_trip(uri: str, local: dict[str, torch.Tensor], step: int) -> list[str]:
    """Load `uri` into zero DTensors on this rank's GPU; differences from `local` (its shards)."""
    into = {k: _sharded(torch.zeros_like(v)) for k, v in local.items()}
    into["step"] = -1
    ckptlib.load(uri, into)
    found = [] if into["step"] == step else [f"step {into['step']}, expected {step}"]
    for key, expected in local.items():
        got = into[key].to_local()
        if got.device.type != _device().type:
            found.append(f"{key}: loaded onto {got.device}")
        if not torch.equal(got.cpu(), expected):
            found.append(f"{key}: the load onto {got.device} differs")
    return found


def pinned_round_trip(uri: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """An async save of sharded CUDA tensors with async_mode="process": staged in pinned shared
    memory (the state changed on the GPU right after the call does not reach it); loaded back
    onto CUDA. Returns the problems and this rank's shards (for the CPU load)."""
    local = _locals(seed=1, rows=61)  # 61 x 257 float32: the shards' bytes are not 64-byte multiples
    state = {k: _sharded(v) for k, v in local.items()}
    state["step"] = 1
    try:
        handle = ckptlib.async_save(uri, state, step=1, async_mode="process")
        with torch.no_grad():
            for key in local:
                state[key].to_local().add_(1)  # after the call: not in the checkpoint
        handle.wait(timeout=WAIT_S)
        found = staging_problems()
        found += _cuda_round_trip(uri, local, step=1)
    finally:
        _release()
    return found, local


def segmented_round_trip(root: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """A first save of "a" (4 MiB a rank: one full segment), then one of "a" and 7.5 MiB more:
    "a" reuses its buffer and the rest takes a second segment, so the writer process reads the
    state from several pinned segments; none of it may go through the socket."""
    import torch.distributed as dist

    from ckptlib.saving import writer_process

    gen = torch.Generator().manual_seed(7 + 100 * dist.get_rank())
    local = {
        "a": torch.randn(1 << 20, generator=gen),  # exactly 4 MiB
        "b": torch.randn(3 << 19, generator=gen),  # 6 MiB
        "c": torch.randn(1000, 777, generator=gen).to(torch.bfloat16),
    }
    state = {k: _sharded(v) for k, v in local.items()}
    try:
        ckptlib.async_save(f"{root}/0", {"a": state["a"], "step": 0}, step=0, async_mode="process").wait(timeout=WAIT_S)
        state["step"] = 1
        ckptlib.async_save(f"{root}/1", state, step=1, async_mode="process").wait(timeout=WAIT_S)
        segments = list(writer_process.current().arena.segments.values())
        staged = sum(v.numel() * v.element_size() for v in local.values())
        found = staging_problems()
        if len(segments) < 2 or staged <= max(s.size for s in segments):
            found.append(f"{staged} staged bytes in segments of {[s.size for s in segments]}: not spread over several")
        found += _cuda_round_trip(f"{root}/1", local, step=1)
    finally:
        _release()
    return found, local


def _training(seed: int):
    """A tanh MLP of LAYERS x (WIDTH, WIDTH) on this rank's GPU, FSDP2 over a CUDA mesh, AdamW."""
    from torch import nn

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    model = nn.Sequential(*layers).to(_device())
    fully_shard = parallel.fully_shard_fn()
    if fully_shard is None:
        raise UnsupportedError(f"torch {torch.__version__} has no FSDP2")
    mesh = _mesh()
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + step)
    return torch.randn(BATCH, WIDTH, generator=gen).to(_device())


def _train(root: str | None):
    """STEPS steps; with a `root`, an async save with background staging at each step of
    SAVE_AT, its copy overlapping that step's forward and backward, waited for right before
    `optimizer.step()`. Returns the model, the optimizer and the full state at each save."""
    model, optim = _training(seed=0)
    expected, handle = {}, None
    for step in range(STEPS):
        if root is not None and step in SAVE_AT:
            if handle is not None:
                handle.wait(timeout=WAIT_S)
            expected[step] = mx.full_state(model, optim)  # the clone at save time
            state = {"model": model, "optim": optim, "step": step}
            handle = ckptlib.async_save(
                f"{root}/{step}", state, step=step, async_mode="process", background_staging=True
            )
        model(_batch(step)).square().mean().backward()
        if handle is not None:
            handle.wait_staged(timeout=WAIT_S)  # the copy is done: the update may change the state
        optim.step()
        optim.zero_grad(set_to_none=True)
    if handle is not None:
        handle.wait(timeout=WAIT_S)
    return model, optim, expected


def overlapped_training(root: str) -> list[str]:
    """Every checkpoint equals the state at its save, and the training equals one that never saved."""
    try:
        model, optim, expected = _train(root)
        found = staging_problems()
        final = mx.full_state(model, optim)
        ref_model, ref_optim, _ = _train(None)
        found += mx.differences(mx.full_state(ref_model, ref_optim), final, "train-vs-never-saved")
        for step, state in expected.items():
            fresh_model, fresh_optim = _training(seed=1)
            into = {"model": fresh_model, "optim": fresh_optim, "step": -1}
            ckptlib.load(f"{root}/{step}", into)
            if into["step"] != step:
                found.append(f"checkpoint {step}: step {into['step']}")
            found += mx.differences(state, mx.full_state(fresh_model, fresh_optim), f"checkpoint-{step}")
    finally:
        _release()
    return found


# --------------------------------------------------------------------------- tests


def _load_on_cpu(uri: str, shards: list[dict[str, torch.Tensor]], step: int) -> None:
    """In this process (no process group, no CUDA): the full tensors are the ranks' shards in order."""
    full = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
    into = {k: torch.zeros_like(v) for k, v in full.items()}
    into["step"] = -1
    assert ckptlib.load(uri, into).step == step
    for key, expected in full.items():
        assert into[key].device.type == "cpu" and torch.equal(into[key], expected), key


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_process_mode_stages_cuda_tensors_in_pinned_shared_memory(world_size, tmp_path, dist_run):
    need_gpus(world_size)
    uri = str(tmp_path / "ck")
    results = dist_run(world_size, pinned_round_trip, uri, backend="nccl")
    assert [problems for problems, _ in results] == [[]] * world_size
    _load_on_cpu(uri, [shards for _, shards in results], step=1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_background_staging_overlaps_the_next_step_and_saves_the_state_before_it(world_size, tmp_path, dist_run):
    need_gpus(world_size)
    problems = dist_run(world_size, overlapped_training, str(tmp_path / "run"), backend="nccl", env=DETERMINISTIC_ENV)
    assert problems == [[]] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_writer_process_reads_a_state_spread_over_several_pinned_segments(world_size, tmp_path, dist_run):
    need_gpus(world_size)
    root = str(tmp_path / "run")
    results = dist_run(world_size, segmented_round_trip, root, backend="nccl")
    assert [problems for problems, _ in results] == [[]] * world_size
    _load_on_cpu(f"{root}/1", [shards for _, shards in results], step=1)
