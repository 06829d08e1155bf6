"""What every benchmark rank does around a timed operation: the sharded state it saves, barriers
around the clock, page-cache control and clean-up. Used inside ranks started by
`ckptlib.testing.launch` (a gloo group is initialised)."""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

from ckptlib.bench.paired import sample, usage

MiB = 1 << 20
N_TENSORS = 16
COLS = 1024


def rank_world() -> tuple[int, int]:
    """(rank, world size) of this rank's default process group."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def make_state(size_mib: int, fill: bool = True) -> dict[str, Any]:
    """{"params": {t0..t15: DTensor}} of `size_mib` MiB of float32 in all, Shard(0) over the ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = rank_world()
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, (size_mib * MiB) // (N_TENSORS * COLS * 4))
    rows -= rows % world
    params = {}
    for i in range(N_TENSORS):
        local = torch.empty(rows // world, COLS)
        if fill:
            gen = torch.Generator().manual_seed(1000 * i + rank)
            local.uniform_(generator=gen)
        else:
            local.zero_()
        params[f"t{i}"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, COLS), stride=(COLS, 1)
        )
    return {"params": params}


def local_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's shards of a `make_state` state."""
    return sum(t.to_local().numel() * t.to_local().element_size() for t in state["params"].values())


def fsync_dir(path: str) -> None:
    """fsync a directory: the names written into it are durable (also the ceilings' raw write)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: str, state: dict[str, Any]) -> None:
    """The disk's limit: this rank's bytes into one file, write + fsync."""
    rank, _ = rank_world()
    os.makedirs(path, exist_ok=True)
    name = os.path.join(path, f"{rank}.bin")
    with open(name, "wb") as f:
        for t in state["params"].values():
            f.write(memoryview(t.to_local().numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path)


def warm(path: str) -> None:
    """Read every file below `path` once (rank 0), so the timed load is from the page cache."""
    rank, _ = rank_world()
    if rank == 0:
        buf = bytearray(8 * MiB)
        for dirpath, _, files in os.walk(path):
            for name in files:
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def evict(path: str) -> None:
    """Make the next read of `path`'s files cold (rank 0): write back every dirty page, then
    drop the files' clean pages with `posix_fadvise(DONTNEED)`. Only these files leave the
    page cache (no root needed; /proc/sys/vm/drop_caches would empty everyone's cache)."""
    rank, _ = rank_world()
    if rank == 0:
        os.sync()
        for dirpath, _, files in os.walk(path):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def raw_read(path: str, state: dict[str, Any]) -> None:
    """The read ceiling of a load: this rank's `raw_write` file read back with preadv straight
    into the state's tensors (no decoding, no checksum)."""
    rank, _ = rank_world()
    fd = os.open(os.path.join(path, f"{rank}.bin"), os.O_RDONLY)
    try:
        offset = 0
        for t in state["params"].values():
            view = memoryview(t.to_local().numpy()).cast("B")
            done = 0
            while done < view.nbytes:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise EOFError(f"{path}/{rank}.bin: short read at {offset + done}")
                done += n
            offset += view.nbytes
    finally:
        os.close(fd)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of `fn()` between two barriers: the slowest rank's time, on every rank."""
    return timed_use(fn)["wall_s"]


def timed_use(fn: Callable[[], Any]) -> dict[str, float]:
    """`fn()` between two barriers: its wall seconds (the slowest rank's, on every rank), and
    this rank's CPU seconds and run-queue wait over the same span (`paired.usage`)."""
    barrier()
    start = sample()
    fn()
    barrier()
    return usage(start, sample())


def settle() -> None:
    """Untimed: write back every dirty page first, so a timed save's fsync waits for its own
    bytes and not for the previous method's (without this, identical saves here took 0.7 s or
    2.8 s depending on what ran before them)."""
    rank, _ = rank_world()
    barrier()
    if rank == 0:
        os.sync()
    barrier()


def remove_tree(path: str) -> None:
    """Remove `path` (rank 0) between barriers."""
    rank, _ = rank_world()
    barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two `make_state` states hold bit-identical local shards."""
    import torch

    return all(torch.equal(a["params"][k].to_local(), b["params"][k].to_local()) for k in a["params"])
