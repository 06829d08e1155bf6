"""Peer replicas: a node's shard files copied to its partner nodes through the process group.

With `replicas=R`, the files of node i also go to nodes (i+1) mod G ... (i+R) mod G, each
rank's file to the rank at the same position of the partner node (`Topology.replica_rank`),
so losing any R nodes (or more, if no R+1 of them are consecutive on the ring) loses no
file. The bytes travel as point-to-point messages of `CHUNK` bytes on the background group
(never through the remote). The receiver writes them into its own node's directory of the
same step under the same name (shard names are unique per rank, so a node root holds its
own files and replicas side by side and a load needs no path mapping), computing the CRC-32
as it writes; a replica that does not match the manifest's size and CRC is removed and is
a ReplicationError naming the sender rank and the file, on every rank. A receiver that
fails to write (its disk full) keeps receiving (the sender must not block) and fails the
same way. A partner that disappears is a ReplicationRankLostError.

Memory: one chunk per transfer in flight per rank, round by round.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ckptlib._runtime import agree as _dist
from ckptlib.errors import CheckpointError, ReplicationError
from ckptlib.format.items.checksum import crc32
from ckptlib.format.native.manifest import Manifest
from ckptlib.manager.cluster.topology import Topology
from ckptlib.storage.base import Storage, SupportsDirectReads

CHUNK = 8 << 20
_TAG = 0x7E71


def shard_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def transfers(topology: Topology, replicas: int, manifest: Manifest) -> list[tuple[int, int, str]]:
    """Every (sender rank, receiver rank, file) of one replication, the same on every rank."""
    out = []
    for node, ranks in enumerate(topology.nodes):
        for partner in topology.partners(node, replicas):
            for rank in ranks:
                name = shard_name(rank)
                if name in manifest.files:
                    out.append((rank, topology.replica_rank(rank, partner), name))
    return out


class _Outgoing:
    def __init__(self, storage: Storage, name: str, size: int, dst: int):
        self.name, self.size, self.dst = name, size, dst
        path = storage.direct_read_path(name) if isinstance(storage, SupportsDirectReads) else None
        self.fd = os.open(path, os.O_RDONLY) if path is not None else None
        self.storage = storage
        self.buf = torch.empty(min(CHUNK, max(size, 1)), dtype=torch.uint8)

    def chunk(self, index: int) -> torch.Tensor:
        start = index * CHUNK
        length = min(CHUNK, self.size - start)
        view = self.buf[:length]
        if self.fd is not None:
            got = os.preadv(self.fd, [memoryview(view.numpy())], start)
            if got != length:
                raise ReplicationError(
                    f"{self.storage.uri}/{self.name}: short read at {start} ({got} of {length} bytes)"
                )
        else:
            data = self.storage.read(self.name, start, length)
            view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return view

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Incoming:
    def __init__(self, storage: Storage, name: str, size: int, expected_crc: int, src: int):
        self.storage, self.name, self.size, self.expected, self.src = storage, name, size, expected_crc, src
        self.buf = torch.empty(min(CHUNK, max(size, 1)), dtype=torch.uint8)
        self.crc = 0
        self.received = 0
        self.error: BaseException | None = None
        self._ctx: Any = None
        self._out: Any = None
        try:
            self._ctx = storage.open_writer(name)
            self._out = self._ctx.__enter__()
        except Exception as exc:  # noqa: BLE001 - reported after every chunk was received
            self.error = exc

    def view(self, index: int) -> torch.Tensor:
        return self.buf[: min(CHUNK, self.size - index * CHUNK)]

    def take(self, data: torch.Tensor) -> None:
        raw = memoryview(data.numpy())
        self.crc = crc32(raw, self.crc)
        self.received += len(raw)
        if self.error is None:
            try:
                self._out.write(raw)
            except Exception as exc:  # noqa: BLE001 - keep receiving; reported at the end
                self.error = exc

    def finish(self) -> None:
        """Close the replica; remove it and raise when it is not what the manifest says."""
        where = f"{self.storage.uri}/{self.name}"
        if self.error is None and (self.received != self.size or self.crc != self.expected):
            self.error = ReplicationError(
                f"{where}: the replica received from rank {self.src} does not match the manifest "
                f"({self.received} bytes, crc32 {self.crc:08x}; the manifest says {self.size} bytes, crc32 "
                f"{self.expected:08x}); removed it",
                path=where,
            )
        if self._ctx is not None:
            exc = self.error
            try:
                self._ctx.__exit__(type(exc) if exc else None, exc, None)
            except Exception as close_error:  # noqa: BLE001 - e.g. ENOSPC at fsync
                self.error = self.error or close_error
        if self.error is not None:
            try:
                self.storage.delete([self.name])
            except Exception:  # noqa: BLE001 - the replica's own error is what counts
                pass
            if isinstance(self.error, ReplicationError):
                raise self.error
            raise ReplicationError(
                f"{where}: cannot keep the replica of {self.name} received from rank {self.src}: "
                f"{type(self.error).__name__}: {self.error}",
                path=where,
            ) from self.error


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def replicate(storage: Storage, manifest: Manifest, topology: Topology, replicas: int, group=None) -> dict[str, int]:
    """Collective: send this rank's files to its partners and keep what it receives (see the
    module docstring); returns {"sent": bytes, "received": bytes} of this rank."""
    if not replicas or not _dist.is_distributed():
        return {"sent": 0, "received": 0}
    rank = topology.rank
    plan = transfers(topology, replicas, manifest)
    outgoing: list[_Outgoing] = []
    incoming: list[_Incoming] = []
    local_error: BaseException | None = None
    try:
        for src, dst, name in plan:
            record = manifest.files[name]
            if src == rank:
                outgoing.append(_Outgoing(storage, name, record.size, dst))
            if dst == rank:
                incoming.append(_Incoming(storage, name, record.size, record.crc32, src))
    except Exception as exc:  # noqa: BLE001 - every rank still takes part in the exchange
        local_error = exc
    sizes = [o.size for o in outgoing] + [i.size for i in incoming]
    rounds = max((-(-s // CHUNK) for s in sizes), default=0)
    sent = 0
    try:
        for index in range(rounds):
            works = []
            for out in outgoing:
                if index * CHUNK < out.size:
                    try:
                        data = out.chunk(index)
                    except Exception as exc:  # noqa: BLE001 - send zeros; the receiver's CRC fails
                        local_error = local_error or exc
                        data = out.buf[: min(CHUNK, out.size - index * CHUNK)].zero_()
                    works.append(dist.isend(data, dst=_global(group, out.dst), group=group, tag=_TAG))
                    sent += data.numel()
            pending = []
            for inc in incoming:
                if index * CHUNK < inc.size:
                    view = inc.view(index)
                    works.append(dist.irecv(view, src=_global(group, inc.src), group=group, tag=_TAG))
                    pending.append((inc, view))
            for work in works:
                work.wait()
            for inc, view in pending:
                inc.take(view)
    finally:
        for out in outgoing:
            out.close()

    def finish() -> None:
        if local_error is not None:
            raise (
                local_error
                if isinstance(local_error, CheckpointError)
                else ReplicationError(
                    f"rank {rank}: cannot replicate {storage.uri}: {type(local_error).__name__}: {local_error}",
                    path=storage.uri,
                )
            )
        errors = []
        for inc in incoming:
            try:
                inc.finish()
            except ReplicationError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    _dist.agree(finish, group, every_pair=True)
    return {"sent": sent, "received": sum(i.received for i in incoming)}


__all__ = ["CHUNK", "replicate", "transfers"]
