"""How much of a save is checksumming, measured the way a profiler would: while the meter is
on, every CRC-32 call of ckptlib's format modules (`checksum.crc32`, however a module imported
it) is timed — wall and this thread's CPU time — and its bytes counted. Bench-only: the library
itself never imports this."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

from ckptlib.format.items import checksum


class CrcMeter:
    """Totals of the CRC-32 calls made while `metering()` was active."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "bytes": self.bytes, "wall_s": self.wall_s, "cpu_s": self.cpu_s}


def _nbytes(data) -> int:
    try:
        return memoryview(data).nbytes
    except TypeError:
        return len(data)


@contextlib.contextmanager
def metering() -> Iterator[CrcMeter]:
    """Meter every `ckptlib.format` module's `crc32` (the name each module calls) until the
    block ends; the modules get the plain function back afterwards."""
    meter = CrcMeter()
    plain = checksum.crc32

    def timed_crc32(data, value: int = 0) -> int:
        w0, c0 = time.perf_counter(), time.thread_time()
        result = plain(data, value)
        meter.wall_s += time.perf_counter() - w0
        meter.cpu_s += time.thread_time() - c0
        meter.calls += 1
        meter.bytes += _nbytes(data)
        return result

    patched = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("ckptlib.format") and getattr(module, "crc32", None) is plain
    ]
    for module in patched:
        module.crc32 = timed_crc32
    try:
        yield meter
    finally:
        for module in patched:
            module.crc32 = plain
