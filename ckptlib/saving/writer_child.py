"""The writer process of async_mode="process" saves: its main loop, and the messages both ends use.

Started by `writer_process` as `python -c "...; writer_child.main(fd, parent_pid)"` (no
`__main__` re-import, no process group, no port), it only *writes*: for each request it opens
the shard through the save's Storage (pickled to it), encodes every item with the same code as
an in-process save (`format.dcp_writer.write_shard`: torch.save's bytes, the CRCs, fsync) and
answers with the shard's FileRecord, or with the exception that stopped it. Tensors are read
in place from the staging segments (`staging_arena`) it mapped once; objects arrive as bytes.

Messages: an 8-byte length, then a pickle; a message may carry file descriptors (a new
segment's memfd), attached to its length with SCM_RIGHTS.
- parent -> child: ("segment", id, size) + fd | ("drop", id) | ("write", pickled storage,
  name, planned bytes, items) | ("stream", pickled storage, name, planned bytes), then
  ("item", item) per item and ("end",) | ("exit",)
- child -> parent: ("ready", pid) once, then one ("ok", FileRecord) or ("error", exception)
  per write; during a stream (a capped save, `capped_staging`) first one ("written",) per item,
  once it is written (the parent then reuses its staging bytes), also for the items a failed
  write skipped.

Lifetime: the child ignores the signals a job scheduler sends a whole job (`IGNORED_SIGNALS`:
the training process decides what they mean, and may still need the writer for its last
save), and exits as soon as its parent process is gone (a pidfd, or polling the
parent pid where pidfds are missing), when the socket closes, or when asked to.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
import struct
import sys
import threading
from typing import Any

_HEADER = struct.Struct("<Q")
_MAX_FDS = 4
# Ignored from the child's first line on (`writer_process` starts it so): the training process
# decides what they mean, and its last save may still need the writer.
IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


# --------------------------------------------------------------------------- messages


def send(sock: socket.socket, message: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one message (and `fds`, with its first bytes)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        sent = socket.send_fds(sock, [header], list(fds))
        if sent < len(header):
            sock.sendall(header[sent:])
    else:
        sock.sendall(header)
    sock.sendall(data)


def recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next message and the descriptors it carried; None at end of stream."""
    first, fds, _flags, _address = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not first:
        return None
    header = bytearray(first)
    while len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            return None
        header += more
    (length,) = _HEADER.unpack(header)
    data = bytearray(length)
    view, got = memoryview(data), 0
    while got < length:
        n = sock.recv_into(view[got:], length - got)
        if not n:
            return None
        got += n
    return pickle.loads(data), list(fds)


# --------------------------------------------------------------------------- the child


def _watch_parent(parent_pid: int) -> None:
    """Exit as soon as the parent process is gone (whichever of its threads started us)."""

    def watch() -> None:
        try:
            pidfd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):
            pidfd = None
        if os.getppid() != parent_pid:  # gone before we watched
            os._exit(0)
        if pidfd is not None:
            select.select([pidfd], [], [])
            os._exit(0)
        while os.getppid() == parent_pid:
            threading.Event().wait(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="ckptlib-writer-watchdog", daemon=True).start()


def _payloads(items: list[tuple], segments: dict[int, mmap.mmap]):
    """The items of a write request as dcp_writer.write_shard takes them (one at a time)."""
    import torch

    for item in items:
        kind = item[0]
        if kind == "bytes":
            yield item[1]
        elif kind == "arena":
            _, segment, offset, nbytes, dtype, shape, stride, storage_offset = item
            storage = torch.frombuffer(segment_map(segments, segment), dtype=torch.uint8, count=nbytes, offset=offset)
            yield storage.view(dtype).as_strided(shape, stride, storage_offset)
        else:  # ("tensor", dtype, shape, stride, bytes): a tensor outside the arena, sent whole
            _, dtype, shape, stride, data = item
            if not data:
                yield torch.empty_strided(shape, stride, dtype=dtype)
            else:
                yield torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def segment_map(segments: dict[int, mmap.mmap], segment: int) -> mmap.mmap:
    try:
        return segments[segment]
    except KeyError:
        raise RuntimeError(f"writer process: staging segment {segment} was never mapped here") from None


def _write(request: tuple, segments: dict[int, mmap.mmap]) -> tuple:
    from ckptlib.format.write.dcp_writer import write_shard

    _, storage_bytes, name, planned, items = request
    try:
        storage = pickle.loads(storage_bytes)
        with storage.open_writer(name) as stream:
            record = write_shard(stream, _payloads(items, segments), planned)
        return ("ok", record)
    except Exception as exc:  # noqa: BLE001 - the parent raises it in the save
        return ("error", _portable(exc))


class _Stream:
    """The items of a streamed write, received as `write_shard` reaches them; each one is
    answered ("written",) when the next is asked for, or by `drain` after a failure."""

    def __init__(self, sock: socket.socket, segments: dict[int, mmap.mmap]):
        self.sock, self.segments = sock, segments
        self.unanswered = 0
        self.ended = False

    def items(self):
        while True:
            self._answer()
            received = recv(self.sock)
            if received is None:
                raise EOFError("the training process closed the socket mid-stream")
            message = received[0]
            if message[0] == "end":
                self.ended = True
                return
            self.unanswered += 1
            yield from _payloads([message[1]], self.segments)

    def _answer(self) -> None:
        while self.unanswered:
            send(self.sock, ("written",))
            self.unanswered -= 1

    def drain(self) -> None:
        """After a failed write: answer every item received or still to come, up to ("end",)."""
        self._answer()
        while not self.ended:
            received = recv(self.sock)
            if received is None or received[0][0] == "end":
                self.ended = True
            else:
                send(self.sock, ("written",))


def _write_streamed(request: tuple, sock: socket.socket, segments: dict[int, mmap.mmap]) -> tuple:
    from ckptlib.format.write.dcp_writer import write_shard

    _, storage_bytes, name, planned = request
    stream = _Stream(sock, segments)
    try:
        storage = pickle.loads(storage_bytes)
        with storage.open_writer(name) as out:
            record = write_shard(out, stream.items(), planned)
        return ("ok", record)
    except Exception as exc:  # noqa: BLE001 - the parent raises it in the save
        answer = ("error", _portable(exc))
    stream.drain()
    return answer


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a CheckpointError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        from ckptlib.errors import CheckpointError

        return CheckpointError(f"{type(exc).__name__}: {exc}", path=getattr(exc, "path", None))


def main(fd: int, parent_pid: int) -> None:
    """The writer process's loop (see the module docstring)."""
    _watch_parent(parent_pid)
    sock = socket.socket(fileno=fd)
    import torch  # noqa: F401 - paid once, before "ready"

    from ckptlib.format.write import dcp_writer  # noqa: F401

    send(sock, ("ready", os.getpid()))
    segments: dict[int, mmap.mmap] = {}
    while True:
        received = recv(sock)
        if received is None:
            break
        message, fds = received
        kind = message[0]
        if kind == "segment":
            segments[message[1]] = mmap.mmap(fds[0], message[2])
            os.close(fds[0])
        elif kind == "drop":
            _unmap(segments.pop(message[1], None))
        elif kind == "write":
            send(sock, _write(message, segments))
        elif kind == "stream":
            send(sock, _write_streamed(message, sock, segments))
        else:
            break
    for mapping in segments.values():
        _unmap(mapping)
    sock.close()
    sys.stdout.flush()


def _unmap(mapping: mmap.mmap | None) -> None:
    if mapping is None:
        return
    try:
        mapping.close()
    except BufferError:  # a tensor of the last write still refers to it: freed with it
        pass
