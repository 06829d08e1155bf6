"""The bound on what a node's root holds, and the report of it: the in-memory tier.

A node root on tmpfs (`/dev/shm`, `ckptlib.memory_root`) with `replicas=1` is a checkpoint in
the peers' memory: the files are RAM, so a save must not fill it (tmpfs past its pages pushes
the training itself into swap or the OOM killer). With `Cluster(max_local_bytes=N)` every
save first checks, on every node, that what the root holds plus what the save adds stays
within N and within the filesystem's free space; otherwise every rank raises
`LocalLimitError` naming the node, its root and the three figures, before anything is
written (nothing saved earlier is touched). What a save adds is the newest step's size on
that node (its own files and the replicas it keeps: steps of one job are the same size), or,
for the first save, the bytes this node's ranks hold in the state times 1 + replicas (an upper
bound: a replicated tensor counts on every rank). `usage()` is the report
(`CheckpointManager.local_usage()`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

from ckptlib._runtime import agree as _dist
from ckptlib.errors import LocalLimitError, StateError, UnsupportedError
from ckptlib.format.native.root import committed_steps, step_dir
from ckptlib.loading.read_cost import filesystem_type

#: Filesystems whose files are memory.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclasses.dataclass(frozen=True)
class LocalUsage:
    """What this node's root holds: `held_bytes` (every file under it), `newest_step_bytes`
    (the newest committed step: its files and the replicas kept for partners), `limit_bytes`
    (`max_local_bytes`, None for no limit), `free_bytes` (the filesystem's), `filesystem`
    ("tmpfs", "ext4", ...) and `in_memory` (a tmpfs or ramfs: lost when the host goes)."""

    root: str
    held_bytes: int
    newest_step_bytes: int
    limit_bytes: int | None
    free_bytes: int | None
    filesystem: str

    @property
    def in_memory(self) -> bool:
        return self.filesystem in MEMORY_FILESYSTEMS


def entry_bytes(path: str) -> dict[str, int]:
    """The bytes the files under `path` take (allocated blocks, so a sparse file counts as what
    it holds), by the top-level entry they are in (a step directory, `latest`, ...), in one
    walk; empty for a missing path."""
    sizes: dict[str, int] = {}
    for parent, _dirs, files in os.walk(path):
        top = os.path.relpath(parent, path).split(os.sep)[0]
        for name in files:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:
                continue  # removed meanwhile (retention, a crashed save's debris)
            key = name if top == "." else top
            sizes[key] = sizes.get(key, 0) + st.st_blocks * 512
    return sizes


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def existing(path: str) -> str:
    """`path`, or its parent while it is not created yet: where its filesystem is asked about."""
    return path if os.path.isdir(path) else os.path.dirname(path.rstrip("/")) or "/"


def usage(root_path: str, limit: int | None, root_storage: Any = None, filesystem: str | None = None) -> LocalUsage:
    """The report of the node root at `root_path` (a directory); `filesystem` when known."""
    sizes = entry_bytes(root_path)
    newest = 0
    if root_storage is not None:
        steps = committed_steps(root_storage)
        if steps:
            newest = sizes.get(step_dir(steps[-1]), 0)
    where = existing(root_path)
    return LocalUsage(
        root=root_path,
        held_bytes=sum(sizes.values()),
        newest_step_bytes=newest,
        limit_bytes=limit,
        free_bytes=free_bytes(where),
        filesystem=filesystem_type(where) if filesystem is None else filesystem,
    )


def state_bytes(state: Mapping[str, Any]) -> int:
    """The bytes of the tensors this rank holds in `state` (a DTensor's local shard; modules
    and optimizers through their state_dict, which holds references, not copies). A tensor
    held twice counts once: the same bytes of one storage (a module's state_dict gives each
    of its tied weights as a new tensor object over the one parameter's storage)."""
    seen: set[Any] = set()

    def walk(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            key = _same_bytes(local)
            if key in seen:
                return 0
            seen.add(key)
            return local.numel() * local.element_size()
        if isinstance(value, Mapping):
            return sum(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(walk(v) for v in value)
        state_dict = getattr(value, "state_dict", None)
        if callable(state_dict):
            return walk(state_dict())
        return 0

    return walk(state)


def _same_bytes(t: torch.Tensor) -> Any:
    """What identifies a tensor's bytes: its storage, place, shape and dtype (the object itself
    where it has no storage to tell, a sparse or meta tensor)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)
    if not ptr or t.layout != torch.strided:
        return id(t)
    return (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def need_bytes(report: LocalUsage, rank_bytes: int) -> int:
    """What the next save adds to this node's root: the newest step's size, else (the first
    save) `rank_bytes`, the node's ranks' state bytes times 1 + replicas."""
    return report.newest_step_bytes or rank_bytes


def check(node: int, report: LocalUsage, need: int) -> None:
    """LocalLimitError when `need` more bytes would pass the limit or the free space."""
    over_limit = report.limit_bytes is not None and report.held_bytes + need > report.limit_bytes
    over_free = report.free_bytes is not None and need > report.free_bytes
    if not (over_limit or over_free):
        return
    bound = (
        f"max_local_bytes={report.limit_bytes}"
        if over_limit
        else f"the {report.free_bytes} bytes free on its {report.filesystem or 'filesystem'}"
    )
    raise LocalLimitError(
        f"node {node}: a save would need about {need} more bytes in {report.root!r}, which holds "
        f"{report.held_bytes}: past {bound}; nothing was written (keep fewer steps, raise the limit, "
        "or give the root more space)",
        path=report.root,
        node=node,
        held=report.held_bytes,
        need=need,
        limit=report.limit_bytes,
    )


class LocalBudget:
    """The cluster tier's bound: the figures each rank adds to the save's one agreement round
    (as many on every rank: a node root on tmpfs beside one on disk, or a limit on one rank
    only, sends a row that says it is not bounded, never fewer numbers into the all_gather) and
    the check of every node from them, its leader's row deciding whether it is bounded and by
    what limit, so every rank raises the same LocalLimitError, or none does."""

    def __init__(self, limit: int | None, root: Any):
        self.limit = limit
        self.root = root
        self.path = root.local_path()
        self.filesystem = "" if self.path is None else filesystem_type(existing(self.path))  # asked once
        self.active = self.path is not None and (limit is not None or self.filesystem in MEMORY_FILESYSTEMS)
        self._rank_bytes: int | None = None  # this rank's state bytes, counted once (the first save)

    def report(self) -> LocalUsage:
        return usage(self.path, self.limit, self.root, self.filesystem)

    def figures(self, is_leader: bool, state: Mapping[str, Any]) -> list[int]:
        """Six numbers on every rank: [bounded, rank bytes, held, newest step, free (-1:
        unknown), limit (-1: none)]; held, newest and free only on a leader, all 0 where this
        rank's root is not bounded."""
        if not self.active:
            return [0, 0, 0, 0, -1, -1]
        if self._rank_bytes is None:
            self._rank_bytes = state_bytes(state)
        limit = -1 if self.limit is None else self.limit
        if not is_leader:
            return [1, self._rank_bytes, 0, 0, -1, limit]
        r = self.report()
        free = -1 if r.free_bytes is None else r.free_bytes
        return [1, self._rank_bytes, r.held_bytes, r.newest_step_bytes, free, limit]

    def check(self, rows: list[list[int]], topology: Any, replicas: int, group=None) -> None:
        """Every rank: each bounded node's need against its leader's figures (`rows`: every
        rank's `figures`). Collective only when a node is refused: the leaders' roots and
        filesystems are gathered then, so the error names them alike on every rank."""
        refused = None
        for node, ranks in enumerate(topology.nodes):
            bounded, _, held, newest, free, limit = rows[ranks[0]]
            if not bounded:
                continue
            report = LocalUsage("", held, newest, None if limit < 0 else limit, None if free < 0 else free, "")
            need = need_bytes(report, sum(rows[r][1] for r in ranks) * (1 + replicas))
            try:
                check(node, report, need)
            except LocalLimitError:
                refused = (node, ranks[0], report, need)
                break
        if refused is None:
            return
        node, leader, report, need = refused
        if _dist.is_distributed():
            root, filesystem = _dist.all_gather_object((self.root.uri, self.filesystem), group)[leader]
        else:  # one process judging every node's figures (a simulation): its root is the only one
            root, filesystem = self.root.uri, self.filesystem
        check(node, dataclasses.replace(report, root=root, filesystem=filesystem), need)


def memory_root(job: str, base: str = "/dev/shm") -> str:
    """The node root of the in-memory tier for `job`: `<base>/ckptlib/<job>` on a tmpfs (or
    ramfs), created with mode 0700; UnsupportedError naming `base` when it is not memory."""
    if not job or "/" in job or job in (".", ".."):
        raise StateError(f"memory_root's job must be a plain name (no '/'), got {job!r}")
    kind = filesystem_type(base) if os.path.isdir(base) else ""
    if kind not in MEMORY_FILESYSTEMS:
        raise UnsupportedError(
            f"{base!r} is not a memory filesystem ({kind or 'missing or unknown'}); the in-memory tier needs a "
            "tmpfs such as /dev/shm (in a container: --shm-size, or an emptyDir with medium: Memory)"
        )
    path = os.path.join(base, "ckptlib", job)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


__all__ = [
    "LocalBudget",
    "LocalUsage",
    "MEMORY_FILESYSTEMS",
    "check",
    "memory_root",
    "need_bytes",
    "state_bytes",
    "usage",
]
