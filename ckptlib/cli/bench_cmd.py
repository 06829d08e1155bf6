"""`ckpt bench`: hands its arguments to the benchmarks in `ckptlib.bench`, with stdout kept for
their report."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

from ckptlib.cli.usage import add_command

DESCRIPTION = """
Benchmarks that measure ckptlib side by side with its baselines in one run; every one has its
own options (`ckpt bench --help`, `ckpt bench scale --help`, `ckpt bench tensors --help`,
`ckpt bench async --help`, `ckpt bench read-once --help`, `ckpt bench recovery --help`):

- ckpt bench [--quick] [--json [OUT]] [--plot OUT.png] ...: this machine's ceilings first
  (parallel write + fsync and read of the scratch disk, memory copy, loopback TCP and gloo),
  then save, load (page cache and cold), resharded load, peak RSS per rank, async save and the
  cloud backends (on emulators on 127.0.0.1) of ckptlib against raw DCP, torch.save, a raw
  parallel write and each cloud SDK, every ckptlib figure also as a % of its ceiling.
- ckpt bench scale [--s3]: planning time and memory, .metadata and manifest sizes at simulated
  world sizes; no ranks spawned; --s3 adds the S3 request counts of real saves and loads on moto.
  With --ranks 2,4,8,16: real gloo ranks, each operation's collectives, payload bytes, process
  groups, store operations and sockets per rank, against plain DCP.
- ckpt bench tensors: save and load of 16 to 10,000 small tensors against raw DCP.
- ckpt bench tier [--remote s3|dir]: the cluster tier on 2 simulated nodes: a save's blocking
  time against a plain local save, its upload against concurrent SDK uploads of the same files,
  and the remote bytes a resume reads (local tiers intact; one node's root lost, replicas=1).
- ckpt bench async: a CPU-bound and an I/O-light training loop's step time while an async save
  runs, without a save and with async_mode="thread" and "process", interleaved in one run at 1,
  2 and 4 ranks; each writer's first-save latency and memory, and a save's peak host memory
  against its shard with and without max_staging_bytes.
- ckpt bench recovery [--remote s3|dir]: a lost host under torchrun's elastic agent (2 simulated
  hosts x 2 ranks, FSDP2, replicas=1), timed phase by phase: detection, rendezvous, setup, load,
  first step; the same resume from peers' replicas against the remote; and the step slowdown of
  an async save every step to an in-memory tier (/dev/shm) with the thread and process writers.
- ckpt bench read-once: storage bytes read (all ranks) and time of DDP and HSDP loads with
  read-once against every rank reading for itself.

Scratch checkpoints go to a temporary directory that is removed. The tables go to stdout
(with --json and no file: the JSON report to stdout, the tables to stderr).

Exit status: 0, or 1 when a load did not return exactly the values saved (recovery: also when a
resume from peers read the remote); 2 usage error.
"""


def add_parser(commands) -> None:
    # Listed for `ckpt --help`; main() hands everything after `bench` to `run_bench`
    # (argparse's REMAINDER would refuse a first argument that starts with "--").
    add_command(
        commands,
        "bench",
        help="benchmark ckptlib against raw DCP, torch.save, the disk and each cloud SDK",
        description=DESCRIPTION,
    )


def run_bench(bench_args: list[str]) -> int:
    """`ckpt bench [scale | tensors | async | read-once | tier | recovery] ARGS...`: the benchmark's own exit code."""
    with report_stdout():
        if bench_args[:1] == ["scale"]:
            from ckptlib.bench import scale

            return scale.main(bench_args[1:])
        if bench_args[:1] == ["tier"]:
            from ckptlib.bench import tier

            return tier.main(bench_args[1:])
        if bench_args[:1] == ["tensors"]:
            from ckptlib.bench import tensor_counts

            return tensor_counts.main(bench_args[1:])
        if bench_args[:1] == ["async"]:
            from ckptlib.bench import async_modes

            return async_modes.main(bench_args[1:])
        if bench_args[:1] == ["recovery"]:
            from ckptlib.bench import recovery

            return recovery.main(bench_args[1:])
        if bench_args[:1] == ["read-once"]:
            from ckptlib.bench import read_once

            return read_once.main(bench_args[1:])
        from ckptlib.bench import throughput

        return throughput.main(bench_args)


@contextlib.contextmanager
def report_stdout() -> Iterator[None]:
    """fd 1 points at stderr inside (ranks inherit it: gloo's C++ side prints "connected"
    lines to stdout on some torch versions), while Python's sys.stdout keeps the real stdout
    for the report, so `--json` output parses."""
    sys.stdout.flush()
    try:
        on_fd1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # captured or replaced: it does not write to fd 1
        on_fd1 = False
    saved = os.dup(1)
    os.dup2(2, 1)
    previous = sys.stdout
    if on_fd1:
        sys.stdout = os.fdopen(saved, "w", closefd=False)
    try:
        yield
    finally:
        try:
            sys.stdout.flush()  # BrokenPipeError when the report's reader went away: fd 1 is restored first
        finally:
            sys.stdout = previous
            os.dup2(saved, 1)
            os.close(saved)
