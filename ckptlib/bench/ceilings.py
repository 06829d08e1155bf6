"""This machine's ceilings, measured first by `ckpt bench`: what the disk, memory and loopback
network can do at all, so every ckptlib figure can be read as a share of its ceiling.

- disk: N processes (N = the ranks of a row) start on a barrier and each write `size / N`
  bytes of incompressible (pseudo-random) data from one preallocated buffer, in 8 MiB
  `os.write`s, into a new file in the scratch directory the benchmark uses, then `fsync` it
  and the directory; time = first start to last end. Then the same files are read back
  cold (each process drops its own file's clean pages with `posix_fadvise(DONTNEED)` first:
  no root needed, and unlike `/proc/sys/vm/drop_caches` it leaves every other process's
  page cache alone) and warm, with `preadv` into a preallocated buffer.
- memory: `dst.copy_(src)` of one large buffer, on 1 thread and on all of torch's threads
  (what bounds staging an async save).
- loopback: one process sends to another over 127.0.0.1: raw TCP (`sendall` of 8 MiB /
  `recv_into`) and torch.distributed gloo send/recv (what ranks exchange tensors with).

Every measurement runs one untimed warm-up round first, then `reps` timed ones, and records
per repetition the wall time, the CPU time and the run-queue wait of the processes involved
(`paired.usage`), and the load average before and after.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from typing import Any

from ckptlib.bench import counted
from ckptlib.bench.paired import load_average, measured, sample, usage
from ckptlib.bench.rank_ops import fsync_dir

MiB = 1 << 20
#: Bytes per write/read call of the disk ceiling and per send of the TCP ceiling.
CHUNK = 8 * MiB
#: The disk ceiling's data buffer: this many bytes of pseudo-random data, written in turn.
PATTERN_BYTES = 64 * MiB


def _context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def pattern(nbytes: int, seed: int) -> memoryview:
    """`nbytes` of incompressible pseudo-random data."""
    import numpy as np

    return memoryview(bytearray(np.random.default_rng(seed).bytes(nbytes)))


def write_file(path: str, data: memoryview, nbytes: int) -> int:
    """Write `nbytes` (the `data` buffer over and over) to a new file at `path` in CHUNK-sized
    `os.write`s, then fsync the file and its directory; returns the write calls made."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    calls = 0
    try:
        done = 0
        while done < nbytes:
            start = done % data.nbytes
            n = min(CHUNK, nbytes - done, data.nbytes - start)
            done += os.write(fd, data[start : start + n])
            calls += 1
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path) or ".")
    return calls


def evict(path: str) -> None:
    """Drop `path`'s clean pages from the page cache (its dirty ones must be written first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path: str, buf: memoryview) -> int:
    """Read `path` whole with `preadv` into `buf` (reused); returns the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while True:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                return done
            done += n
    finally:
        os.close(fd)


def _disk_worker(index: int, directory: str, nbytes: int, reps: int, barrier, results) -> None:
    try:
        data = pattern(min(nbytes, PATTERN_BYTES) or 1, seed=index)
        buf = memoryview(bytearray(min(CHUNK, max(nbytes, 1))))
        path = os.path.join(directory, f"ceiling-{os.getpid()}-{index}.bin")
        out = []
        for _ in range(reps + 1):
            if index == 0:
                os.sync()  # earlier writes are not this round's fsync's work
            barrier.wait()
            s0 = sample()
            write_file(path, data, nbytes)
            s1 = sample()
            evict(path)
            barrier.wait()
            s2 = sample()
            got = read_file(path, buf)
            s3 = sample()
            barrier.wait()
            s4 = sample()
            read_file(path, buf)
            s5 = sample()
            os.unlink(path)
            out.append(
                {
                    "write": (s0[0], s1[0], usage(s0, s1)),
                    "read_cold": (s2[0], s3[0], usage(s2, s3)),
                    "read_warm": (s4[0], s5[0], usage(s4, s5)),
                    "bytes_read": got,
                }
            )
        results.put((index, out, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        barrier.abort()
        results.put((index, None, f"{type(exc).__name__}: {exc}"))


def combine_phases(per_process: list[list[dict[str, Any]]], phase: str) -> tuple[list[float], list[dict[str, float]]]:
    """Per repetition: the phase's time from the first process's start to the last one's end,
    and the processes' CPU and run-queue seconds summed (wall = that time)."""
    seconds, use = [], []
    for rep in zip(*per_process):
        start = min(r[phase][0] for r in rep)
        end = max(r[phase][1] for r in rep)
        seconds.append(end - start)
        use.append(
            {
                "wall_s": end - start,
                "cpu_s": sum(r[phase][2]["cpu_s"] for r in rep) / len(rep),
                "runq_s": sum(r[phase][2]["runq_s"] for r in rep) / len(rep),
            }
        )
    return seconds, use


def disk(directory: str, total_bytes: int, processes: int, reps: int, timeout: float = 900.0) -> dict[str, Any]:
    """Parallel write + fsync, cold read and warm read of `total_bytes` split over `processes`
    processes in `directory`; every timing per repetition (the warm-up round dropped)."""
    ctx = _context()
    barrier = ctx.Barrier(processes, timeout=timeout)
    results = ctx.Queue()
    share = total_bytes // processes
    sizes = [share + (1 if i < total_bytes % processes else 0) for i in range(processes)]
    before = load_average()
    procs = [
        ctx.Process(target=_disk_worker, args=(i, directory, sizes[i], reps, barrier, results), daemon=True)
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    got: dict[int, list] = {}
    errors = []
    try:
        for _ in procs:
            index, out, error = results.get(timeout=timeout)
            if error:
                errors.append(f"process {index}: {error}")
            else:
                got[index] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("disk ceiling failed: " + "; ".join(errors))
    per_process = [got[i][1:] for i in range(processes)]  # the warm-up round dropped
    row: dict[str, Any] = {
        "bytes": total_bytes,
        "processes": processes,
        "load_before": before,
        "load_after": load_average(),
        "bytes_read": [sum(r["bytes_read"] for r in rep) for rep in zip(*per_process)],
    }
    for phase in ("write", "read_cold", "read_warm"):
        row[f"{phase}_s"], row[f"{phase}_usage"] = combine_phases(per_process, phase)
    return row


def memcpy(nbytes: int, reps: int, threads: list[int] | None = None) -> list[dict[str, Any]]:
    """`dst.copy_(src)` of `nbytes` on each thread count (default: 1 and all of torch's)."""
    import torch

    default = torch.get_num_threads()
    counts = threads or sorted({1, default})
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # both touched: the timed copies fault no pages in
    rows = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            before = load_average()
            dst.copy_(src)  # warm-up, discarded
            use = [measured(lambda: dst.copy_(src)) for _ in range(reps)]
            rows.append(
                {
                    "bytes": nbytes,
                    "threads": n,
                    "seconds": [u["wall_s"] for u in use],
                    "usage": use,
                    "load_before": before,
                    "load_after": load_average(),
                }
            )
    finally:
        torch.set_num_threads(default)
    return rows


def _tcp_sender(port: int, nbytes: int, rounds: int) -> None:
    data = pattern(min(CHUNK, nbytes), seed=7)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(rounds):
            if conn.recv(1) != b"g":
                return
            done = 0
            while done < nbytes:
                n = min(data.nbytes, nbytes - done)
                conn.sendall(data[:n])
                done += n


def tcp_loopback(nbytes: int, reps: int, timeout: float = 300.0) -> dict[str, Any]:
    """Raw TCP over 127.0.0.1 between two processes: `nbytes` per repetition, timed at the
    receiver from its "go" to the last byte."""
    ctx = _context()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(timeout)
    port = server.getsockname()[1]
    sender = ctx.Process(target=_tcp_sender, args=(port, nbytes, reps + 1), daemon=True)
    sender.start()
    before = load_average()
    use = []
    try:
        conn, _ = server.accept()
        conn.settimeout(timeout)
        with conn:
            buf = memoryview(bytearray(min(CHUNK, nbytes)))
            for rep in range(reps + 1):
                start = sample()
                conn.sendall(b"g")
                got = 0
                while got < nbytes:
                    n = conn.recv_into(buf, min(buf.nbytes, nbytes - got))
                    if not n:
                        raise RuntimeError(f"loopback sender stopped after {got} of {nbytes} bytes")
                    got += n
                if rep:  # round 0 is the warm-up
                    use.append(usage(start, sample()))
    finally:
        server.close()
        sender.join(timeout=10)
        if sender.is_alive():
            sender.kill()
    return {
        "bytes": nbytes,
        "seconds": [u["wall_s"] for u in use],
        "usage": use,
        "load_before": before,
        "load_after": load_average(),
    }


def rank_gloo_loopback(nbytes: int, reps: int) -> dict[str, Any]:
    """In 2 ranks (ckptlib.testing.launch): rank 0 sends a tensor of `nbytes` to rank 1 with
    gloo, timed between barriers; the warm-up round dropped."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tensor = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    use = []
    for rep in range(reps + 1):
        dist.barrier()
        start = sample()
        if rank == 0:
            dist.send(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
        dist.barrier()
        if rep:
            use.append(usage(start, sample()))
    ok = rank != 1 or bool(tensor.eq(1).all())
    return {"rank": rank, "usage": use, "ok": ok}


def gloo_loopback(launch, nbytes: int, reps: int, timeout: float = 300.0) -> dict[str, Any]:
    """`rank_gloo_loopback` on 2 ranks; per repetition the slower rank's time."""
    before = load_average()
    out = launch(2, rank_gloo_loopback, nbytes, reps, timeout=timeout)
    use = [max(pair, key=lambda u: u["wall_s"]) for pair in zip(*(r["usage"] for r in out))]
    return {
        "bytes": nbytes,
        "seconds": [u["wall_s"] for u in use],
        "usage": use,
        "ok": all(r["ok"] for r in out),
        "load_before": before,
        "load_after": load_average(),
    }


def measure(args, launch, log) -> dict[str, Any]:
    """Every ceiling a `ckpt bench` run compares with: the disk at each (size, ranks) of the
    run, in its scratch directory; the memory copy; TCP and gloo over loopback."""
    started = time.perf_counter()
    out: dict[str, Any] = {"disk": [], "memcpy": [], "tcp": None, "gloo": None, "errors": []}
    directory = args.scratch
    for size in args.sizes:
        for ws in args.world_sizes:
            log(f"ceiling: disk, {size} MiB over {counted(ws, 'process', 'processes')}")
            try:
                out["disk"].append({"size_mib": size, "world": ws, **disk(directory, size * MiB, ws, args.reps)})
            except (OSError, RuntimeError) as exc:
                out["errors"].append(f"disk {size} MiB x {ws}: {exc}")
    copy_mib = max(64, min(512, max(args.sizes)))
    log(f"ceiling: memory copy of {copy_mib} MiB")
    out["memcpy"] = memcpy(copy_mib * MiB, args.reps)
    net_mib = 64 if not args.quick else 16
    log(f"ceiling: loopback TCP and gloo, {net_mib} MiB")
    try:
        out["tcp"] = tcp_loopback(net_mib * MiB, args.reps)
    except (OSError, RuntimeError) as exc:
        out["errors"].append(f"tcp: {exc}")
    try:
        out["gloo"] = gloo_loopback(launch, net_mib * MiB, args.reps, timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - a ceiling that cannot be measured is reported, not fatal
        out["errors"].append(f"gloo: {type(exc).__name__}: {exc}")
    out["seconds"] = time.perf_counter() - started
    return out
