"""Faults inside the writer process of async_mode="process" saves (ckptlib.saving.writer_process).

A monkeypatch in the training process does not reach the writer process, so the fault travels
with the save's storage instead: `FaultyShards` is a LocalStorage whose shard streams
(`*.distcp`) fail in a chosen way after `after` bytes, and which the writer process unpickles
(this module is importable there: it gets the parent's sys.path). Its children (`child(name)`,
the manager's step directories) keep the fault where their path contains `under`.

Faults: "eio" (the write raises EIO: LocalStorage turns it into a StorageError and removes the
partial file), "exit" (the writer process exits with code 3 mid-file), "block" (the write
creates `<root>.blocked` and then waits: the test kills the writer), "slow" (each write waits
`delay` seconds first: a save that stays in flight a while).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import BinaryIO, Iterator

from ckptlib.storage.local import LocalStorage

BLOCKED_SUFFIX = ".blocked"


class FaultyShards(LocalStorage):
    def __init__(self, root: str, fault: str, *, after: int = 4096, under: str | None = None, delay: float = 0.0):
        super().__init__(root)
        self.fault, self.after, self.under, self.delay = fault, after, under, delay

    def child(self, name: str) -> "FaultyShards":
        return FaultyShards(self._path(name), self.fault, after=self.after, under=self.under, delay=self.delay)

    def _applies(self, path: str) -> bool:
        return path.endswith(".distcp") and (self.under is None or self.under in self.root)

    @contextlib.contextmanager
    def open_writer(self, path: str) -> Iterator[BinaryIO]:
        with super().open_writer(path) as stream:
            yield _FaultyStream(stream, self, self.local_path(path)) if self._applies(path) else stream


class _FaultyStream:
    def __init__(self, stream, storage: FaultyShards, full: str):
        self.stream, self.storage, self.full = stream, storage, full
        self.written = 0

    def write(self, data) -> int:
        storage = self.storage
        if storage.fault == "slow":
            time.sleep(storage.delay)
            return self.stream.write(data)
        n = memoryview(data).nbytes
        if self.written + n <= storage.after:
            self.written += n
            return self.stream.write(data)
        self.stream.write(memoryview(data).cast("B")[: storage.after - self.written])
        self.stream.flush()  # the partial file is really there
        if storage.fault == "eio":
            raise OSError(5, "EIO (injected)")
        if storage.fault == "exit":
            os._exit(3)
        with open(storage.root + BLOCKED_SUFFIX, "w") as marker:
            marker.write(str(os.getpid()))
        time.sleep(120)
        raise OSError(5, "blocked write was never killed (injected)")

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()
