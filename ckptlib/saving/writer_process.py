"""The long-lived writer process of async saves with async_mode="process", seen from the
training process.

Why a process: an async save's expensive part (encoding every item as torch.save's bytes,
the CRCs, the writes and fsync) runs in a thread of the training process otherwise, where it
competes with the training loop for the GIL. Here the background thread keeps everything
collective (DCP's planning, the gathers, the coordinator's `.metadata`, the commit, the
manager's publish) and hands each shard to one writer process per rank, which only writes
(`writer_child`). Failures stay on today's path: the error of a shard write (a write error, a
full disk, the writer dying) is raised in DCP's `write_data` on that rank, so every rank fails
the save alike, its partial files are removed and nothing is committed.

Staging: `background_save.stage` copies the state into this process's `StagingArena` (memfd
shared memory); the writer maps each segment once and reads the tensors in place.

Start-up: `writer()` starts the process when a manager with async_mode="process" is created,
or at the first process-mode `async_save`, before the state is staged (`subprocess.Popen`: the
training thread waits for no import), and the background thread waits for it to be ready
(importing torch takes it a second or two) before its first write.
A writer that died is replaced at the next save (with a warning when it died between saves).
`shutdown()` (`release_staging()`, `CheckpointManager.close()`, interpreter exit) stops it and
frees the staging memory. Forked children of the training process (data-loader workers) do
not inherit it.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import warnings
from typing import Any, Iterable

import torch

from ckptlib._runtime import progress
from ckptlib.errors import CheckpointError, StateError, WriterProcessError, stacklevel_outside_ckptlib
from ckptlib.format.native.manifest import FileRecord
from ckptlib.format.write.dcp_writer import InProcessShards, _tensor_for_save
from ckptlib.saving import capped_staging, writer_child
from ckptlib.saving.staging_arena import StagingArena, unavailable_reason

MODES = ("thread", "process")
WRITERS = ("auto",) + MODES  # "auto": the process where it can work (`check_mode`)
READY_TIMEOUT_S = 600.0  # a loaded machine can take minutes to import torch
_END = object()

_lock = threading.Lock()
_writer: "WriterProcess | None" = None
_warned: set[str] = set()


def check_mode(async_mode: Any) -> str:
    """The writer `async_mode` (one of WRITERS) runs here: "process" or "thread" as given,
    "thread" (with a warning, once) where a writer process cannot work on this machine; "auto"
    is "process" where it can and "thread" elsewhere, silently. StateError for anything else."""
    if async_mode not in WRITERS:
        raise StateError(f"async_mode must be 'auto', 'thread' or 'process', got {async_mode!r}")
    if async_mode == "auto":
        return "process" if unavailable_reason() is None else "thread"
    if async_mode == "process":
        reason = unavailable_reason()
        if reason is not None:
            _warn_once(f'async_mode="process" is not available here ({reason}); saving in a background thread')
            return "thread"
    return async_mode


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel_outside_ckptlib())


def writer() -> "WriterProcess":
    """This process's writer (started now if none runs; not waited for)."""
    global _writer
    with _lock:
        if _writer is None:
            _writer = WriterProcess()
        _writer.start()
        return _writer


def current() -> "WriterProcess | None":
    """The writer if one was started (tests and benchmarks look at its pid and arena)."""
    return _writer


def shutdown() -> None:
    """Stop the writer process and free its staging memory (the caller waited for the saves)."""
    global _writer
    with _lock:
        found, _writer = _writer, None
    if found is not None:
        found.close()


class WriterProcess:
    """A writer process and the staging arena it maps; `write_shard` is a dcp_writer.ShardBackend."""

    def __init__(self) -> None:
        self.arena = StagingArena()
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None
        self.starts = 0  # how many writer processes this one has started
        self.bytes_sent_whole = 0  # tensor bytes that were not in shared memory and went through the socket
        self._sock: socket.socket | None = None
        self._ready = False
        self._lock = threading.Lock()  # one request at a time (saves of several groups share it)

    def __repr__(self) -> str:
        return f"WriterProcess(pid={self.pid}, {self.arena!r})"

    # -- the process ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the process unless it runs (its previous one having died between saves).
        A running one is seen without waiting for a write in flight (another group's save)."""
        process = self.process
        if process is not None and process.poll() is None:
            return
        with self._lock:
            if self.process is not None and self.process.poll() is None:
                return
            if self.process is not None:
                warnings.warn(
                    f"the background writer process (pid {self.pid}) had exited (exit code "
                    f"{self.process.returncode}) between saves; starting a new one",
                    RuntimeWarning,
                    stacklevel=stacklevel_outside_ckptlib(),
                )
                self._discard()
            self._spawn()

    def _spawn(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The signals a scheduler sends a whole job are ignored before anything is imported.
        code = (
            "import signal, sys\n"
            f"for name in {writer_child.IGNORED_SIGNALS!r}:\n"
            "    if hasattr(signal, name): signal.signal(getattr(signal, name), signal.SIG_IGN)\n"
            "sys.path[:0] = __import__('json').loads(sys.argv[1])\n"
            "from ckptlib.saving.writer_child import main\n"
            "main(int(sys.argv[2]), int(sys.argv[3]))\n"
        )
        path = json.dumps([p for p in sys.path if p])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, path, str(child.fileno()), str(os.getpid())],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            child.close()
        self._sock = parent
        self.pid = self.process.pid
        self.starts += 1
        self._ready = False
        self.arena.forget_sent()

    def _await_ready(self) -> None:
        if self._ready:
            return
        assert self._sock is not None
        self._sock.settimeout(READY_TIMEOUT_S)
        try:
            received = writer_child.recv(self._sock)
        except TimeoutError:
            raise WriterProcessError(
                f"the background writer process (pid {self.pid}) was not ready after {READY_TIMEOUT_S:.0f} s"
            ) from None
        except OSError:
            received = None
        finally:
            if self._sock is not None:
                self._sock.settimeout(None)
        if received is None or received[0][0] != "ready":
            raise WriterProcessError(f"the background writer process (pid {self.pid}) {self._how()} while starting")
        self._ready = True

    def _how(self) -> str:
        """How the process ended: "exited (exit code 1)", "died (killed by SIGKILL)"."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"died (killed by {name})"
        return f"exited (exit code {code})"

    def _discard(self) -> None:
        """Forget a process that is gone (or is to go); close our end of its socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.process = None
        self._ready = False

    def close(self) -> None:
        """Ask the process to exit, wait for it, and free the arena."""
        with self._lock:
            # One still importing torch has nothing to finish: `_discard` kills it.
            if self._ready and self._sock is not None and self.process is not None and self.process.poll() is None:
                try:
                    writer_child.send(self._sock, ("exit",))
                    self.process.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._discard()
            self.arena.close()

    # -- writes -----------------------------------------------------------------------------
    def write_shard(self, transaction, name: str, payloads: Iterable[Any], planned_bytes: int) -> FileRecord:
        """Encode and write shard `name` in the writer process (see dcp_writer.ShardBackend)."""
        storage = transaction.storage
        sent_storage = _sendable(storage)
        if sent_storage is None:
            return InProcessShards().write_shard(transaction, name, payloads, planned_bytes)
        where = f"{storage.uri.rstrip('/')}/{name}"
        with transaction.writing_shard(name):
            items = [self._describe(data) for data in payloads]
            self.start()  # replaces a writer that died since the last save
            progress.add_total(planned_bytes)
            with self._lock:
                record = self._request(sent_storage, name, planned_bytes, items, where)
            progress.advance(record.size)
            return record

    def write_streamed(
        self, transaction, name: str, payloads: Iterable[Any], planned_bytes: int, ring, on_staged
    ) -> FileRecord:
        """`write_shard` of a capped save (`capped_staging`): each tensor is copied into `ring`
        (a segment of this arena) and sent as the writer process reaches it; a piece's bytes are
        reused once the process answers that it wrote it. `on_staged()` once the last is copied."""
        storage = transaction.storage
        sent_storage = _sendable(storage)
        if sent_storage is None:
            pieces = capped_staging.staged_pieces(payloads, ring, on_staged)
            return InProcessShards().write_shard(transaction, name, pieces, planned_bytes)
        where = f"{storage.uri.rstrip('/')}/{name}"
        with transaction.writing_shard(name):
            self.start()
            progress.add_total(planned_bytes)
            with self._lock:
                try:
                    record = self._stream(sent_storage, name, planned_bytes, payloads, ring, on_staged, where)
                finally:
                    ring.clear()  # whatever happened, no piece is in use any more
            progress.advance(record.size)
            return record

    def _stream(self, storage: bytes, name: str, planned: int, payloads, ring, on_staged, where: str) -> FileRecord:
        owned: collections.deque[bool] = collections.deque()  # per item sent and not yet written: in the ring?

        def written() -> None:  # the process wrote the oldest item sent
            answer = writer_child.recv(self._sock)
            if answer is None or answer[0][0] != "written":
                raise OSError("the writer process stopped answering")
            if owned.popleft():
                ring.free_oldest()

        try:
            self._await_ready()
            assert self._sock is not None
            self._send_segments()
            writer_child.send(self._sock, ("stream", storage, name, planned))
            items = iter(payloads)
            current = next(items, _END)
            if current is _END:
                on_staged()
            while current is not _END:
                piece = None
                if capped_staging.stageable(current):
                    while (piece := ring.put(current)) is None:
                        written()
                item = self._describe(current if piece is None else piece)
                following = next(items, _END)
                if following is _END:
                    on_staged()
                writer_child.send(self._sock, ("item", item))
                owned.append(piece is not None)
                del piece
                current = following
            writer_child.send(self._sock, ("end",))
            while owned:
                written()
            answer = writer_child.recv(self._sock)
        except OSError:
            answer = None
        except BaseException:  # not ready, or interrupted mid-stream: this process is of no more use
            self._discard()
            raise
        return self._answered(answer, where)

    def _send_segments(self) -> None:
        assert self._sock is not None
        for segment_id in self.arena.dropped():
            writer_child.send(self._sock, ("drop", segment_id))
        for segment in self.arena.unsent():
            writer_child.send(self._sock, ("segment", segment.id, segment.size), [segment.fd])

    def _describe(self, data: Any) -> tuple:
        if isinstance(data, io.BytesIO):
            return ("bytes", data.getvalue())
        if not isinstance(data, torch.Tensor):
            return ("bytes", bytes(data))
        found = self.arena.locate(data)
        if found is not None:
            return found
        tensor = _tensor_for_save(data)  # a tensor not staged in shared memory: its bytes, sent whole
        if tensor.numel() == 0:
            return ("tensor", tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), b"")
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        self.bytes_sent_whole += len(raw)
        return ("tensor", tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), raw)

    def _request(self, storage: bytes, name: str, planned_bytes: int, items: list[tuple], where: str) -> FileRecord:
        try:
            self._await_ready()
            self._send_segments()
            assert self._sock is not None
            writer_child.send(self._sock, ("write", storage, name, planned_bytes, items))
            answer = writer_child.recv(self._sock)
        except OSError:
            answer = None
        except BaseException:  # not ready, or interrupted mid-message: this process is of no more use
            self._discard()
            raise
        return self._answered(answer, where)

    def _answered(self, answer, where: str) -> FileRecord:
        """The FileRecord of a write's answer, or its failure raised (None: the process is gone)."""
        if answer is None:
            how = self._how()
            pid = self.pid
            self._discard()
            raise WriterProcessError(
                f"the background writer process (pid {pid}) {how} while writing {where}", path=where
            )
        (status, value), _fds = answer
        if status == "ok":
            return value
        if isinstance(value, BaseException):
            raise value
        raise CheckpointError(f"the background writer process failed writing {where}: {value}", path=where)


def _sendable(storage) -> bytes | None:
    """`storage` pickled for the writer process; None (with a warning, once) when it cannot
    travel: its shards are then written in the background thread."""
    try:
        if type(storage).__module__ == "__main__":  # the writer process does not run the caller's script
            raise TypeError("its class is defined in __main__")
        return pickle.dumps(storage)
    except Exception as exc:  # noqa: BLE001 - a storage that cannot travel is written here
        _warn_once(
            f'async_mode="process": {type(storage).__name__} ({storage.uri}) cannot be sent to the writer '
            f"process ({type(exc).__name__}: {exc}); its shards are written in the background thread"
        )
        return None


def _after_fork_in_child() -> None:
    """A forked child (a data-loader worker) has no writer: the parent's stays the parent's."""
    global _writer, _lock
    _lock = threading.Lock()
    _writer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["MODES", "WRITERS", "WriterProcess", "check_mode", "current", "shutdown", "writer"]
