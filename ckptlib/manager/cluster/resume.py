"""Which step a cluster tier resumes from, and where its copies are: the inventory.

Each node's leader lists its own local root: every committed step with its manifest's CRC
(a checkpoint *version*: the same step saved twice is two versions), its commit order and
which of the manifest's files the node holds (present with the manifest's size; a torn or
missing file is not held). Rank 0 adds the remote's committed steps (a remote it cannot
reach is a RemoteUnavailableWarning: the local tiers still count; with no local step either,
a load cannot tell "nothing to resume" and raises RemoteUnavailableError).

A version is resumable when every file of its manifest has a holder: some node, or the
remote (which only ever commits complete, verified copies). The step to resume is the
resumable version newest in *commit order* (the manifests' commit records), never merely the
highest step number: after a rollback the abandoned higher step is older in commit order. A
newer version that is not resumable (a damaged or half-replicated step, a lost node without
replicas) is skipped with a SkippedDamagedStepWarning and blocks nothing.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping

from ckptlib._runtime import agree as _dist
from ckptlib.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, warn_scrubbed
from ckptlib.format.native.manifest import MANIFEST_NAME, METADATA_NAME, Manifest
from ckptlib.format.native.root import LATEST, scan, step_dir
from ckptlib.format.read.copies import Copies, Copy
from ckptlib.loading.loading import LoadResult, load
from ckptlib.manager.cluster.damaged import node_key
from ckptlib.manager.cluster.remote_tier import RemoteTier
from ckptlib.manager.cluster.replication import shard_name, transfers
from ckptlib.manager.cluster.topology import Topology
from ckptlib.storage.base import Storage


def copies_for(choice: Choice, topology: Topology, local: Storage, remote: Storage | None) -> Copies:
    """This rank's copies of `choice` (see the module docstring)."""
    mine = frozenset(choice.holders.get(topology.node, frozenset()))
    found = []
    if mine:
        found.append(Copy("local", local, files=mine, key=node_key(topology.node, local.uri)))
    if remote is not None and choice.remote:
        found.append(Copy("remote", remote))
    return Copies(found)


def load_version(
    choice: Choice,
    manifest_bytes: bytes,
    metadata_bytes: bytes,
    topology: Topology,
    local: Storage,
    remote: Storage | None,
    state: Mapping[str, Any],
    group,
    kwargs: dict[str, Any],
) -> LoadResult:
    """Collective: load `choice` into `state` from the nearest copies; the LoadResult's
    `bytes_by_source` counts the bytes each kind of copy served, over every rank."""
    copies = copies_for(choice, topology, local, remote)
    uri = remote if remote is not None and choice.remote and topology.node not in choice.holders else local
    return load(uri, state, process_group=group, copies=copies, info=(manifest_bytes, metadata_bytes), **kwargs)


class SkippedDamagedStepWarning(UserWarning):
    """A committed step newer (in commit order) than the one resumed cannot be used: a file
    of it has no intact copy anywhere. It was skipped."""


class UploadSkippedWarning(UserWarning):
    """A resumed step the remote lacks was not uploaded: some file of it has no intact copy on
    any node (the load did not need it, or read it from a copy it then set aside)."""


class RemoteUnavailableWarning(UserWarning):
    """The remote root could not be read; the choice used the local tiers only."""


@dataclasses.dataclass(frozen=True)
class NodeCopy:
    """One node's copy of one checkpoint version, as its leader found it."""

    step: int
    crc: int  # CRC-32 of the manifest's bytes: the version
    order: tuple
    files: int  # how many files the manifest lists
    held: frozenset[str]


@dataclasses.dataclass
class Version:
    """A checkpoint version and every copy of it (rank 0's view)."""

    step: int
    crc: int
    order: tuple
    files: int
    holders: dict[int, frozenset[str]] = dataclasses.field(default_factory=dict)  # node -> files held
    remote: bool = False

    def unheld(self) -> int:
        held: set[str] = set()
        for names in self.holders.values():
            held |= names
        return self.files - len(held)

    @property
    def resumable(self) -> bool:
        return self.remote or self.unheld() == 0


@dataclasses.dataclass(frozen=True)
class Choice:
    """The version to load and where its copies are, the same on every rank."""

    step: int
    crc: int
    order: tuple
    holders: dict[int, frozenset[str]]  # node (this job's) -> files its root holds
    remote: bool  # the remote holds it complete
    remote_reachable: bool
    remote_latest: tuple | None  # commit order of the remote `latest` (None: none, or unreachable)

    @property
    def source_node(self) -> int | None:
        """The lowest node holding the manifest and `.metadata`, or None (read them remotely)."""
        return next((node for node in sorted(self.holders) if METADATA_NAME in self.holders[node]), None)


def node_copies(root: Storage) -> list[NodeCopy]:
    """A leader: every committed step of its own root, with the files it holds."""
    out = []
    pointer = _pointer(root)
    for info in scan(root):
        if info.state != "committed":
            continue
        step_root = root.child(info.name)
        try:
            data = step_root.read(MANIFEST_NAME)
            manifest = Manifest.from_bytes(data, f"{step_root.uri}/{MANIFEST_NAME}")
        except (CheckpointError, OSError):
            continue  # a damaged manifest: this node holds nothing of it
        held = frozenset(n for n, r in manifest.files.items() if info.files.get(n) == r.size)
        order = manifest.commit_order(named_by_latest=info.name == pointer)
        out.append(NodeCopy(info.step, zlib.crc32(data), order, len(manifest.files), held))
    return out


def _pointer(root: Storage) -> str | None:
    """The step directory a root's `latest` names (None: none, or unreadable)."""
    try:
        return root.read_pointer(LATEST)
    except (CheckpointError, OSError):
        return None


def gather_versions(root: Storage, topology: Topology, group=None) -> dict[tuple[int, int], Version]:
    """Collective: every node's copies, merged on every rank (rank 0 adds the remote later)."""
    mine = _dist.agree(lambda: node_copies(root) if topology.is_leader else [], group)
    versions: dict[tuple[int, int], Version] = {}
    for rank, copies in enumerate(_dist.all_gather_object(mine, group)):
        for copy in copies or []:
            key = (copy.step, copy.crc)
            version = versions.setdefault(key, Version(copy.step, copy.crc, copy.order, copy.files))
            version.holders[topology.node_of(rank)] = copy.held
    return versions


def add_remote(
    versions: dict[tuple[int, int], Version], remote: RemoteTier, unreachable: list[str]
) -> tuple[bool, tuple | None]:
    """Rank 0: the remote's committed steps into `versions`; (reachable, commit order of its
    `latest`). A remote it cannot read: why, appended to `unreachable`."""
    try:
        listed = remote.versions()
        latest = remote.latest_order()
    except (CheckpointError, OSError) as exc:
        unreachable.append(f"{remote.uri}: cannot read the remote root ({type(exc).__name__}: {exc})")
        return False, None
    pointer = _pointer(remote.storage)
    for step, data in listed:
        try:
            manifest = Manifest.from_bytes(data, f"{remote.path(step)}/{MANIFEST_NAME}")
        except CheckpointError:
            continue
        key = (step, zlib.crc32(data))
        order = manifest.commit_order(named_by_latest=step_dir(step) == pointer)
        version = versions.setdefault(key, Version(step, key[1], order, len(manifest.files)))
        version.remote = True
    return True, latest


def choose(
    versions: dict[tuple[int, int], Version],
    step: int | None,
    *,
    where: str,
    remote_reachable: bool,
    remote_latest: tuple | None,
    skipped: list[str],
) -> list[Choice]:
    """Rank 0: the resumable versions (`step`: of that step), newest in commit order first: the
    first is the one to load, the others its fallbacks should it prove damaged at read time.
    Newer versions that cannot be resumed are skipped (why: appended to `skipped`, for a
    SkippedDamagedStepWarning on every rank). CheckpointNotFoundError when `step` has none."""
    candidates = sorted(
        (v for v in versions.values() if step is None or v.step == step), key=lambda v: v.order, reverse=True
    )
    chosen = []
    for version in candidates:
        if version.resumable:
            chosen.append(
                Choice(
                    version.step,
                    version.crc,
                    version.order,
                    dict(version.holders),
                    version.remote,
                    remote_reachable,
                    remote_latest,
                )
            )
        elif not chosen:
            skipped.append(
                f"{where}: step {version.step} (committed on {len(version.holders)} node(s)"
                f"{'' if remote_reachable else '; the remote is unreachable'}) cannot be resumed: "
                f"{version.unheld()} of its {version.files} files have no intact copy; skipping it"
            )
    if not chosen and step is not None:
        raise CheckpointNotFoundError(f"{where} has no resumable step {step}", path=f"{where}/{step_dir(step)}")
    return chosen


def warn_all(texts: list[str], category: type[Warning]) -> None:
    """Issue the warnings rank 0 found, on every rank (the texts travel with its decision)."""
    for text in texts:
        warn_scrubbed(text, category)  # they may quote a storage error (an endpoint's password)


def own_files(topology: Topology, manifest: Manifest, replicas: int) -> tuple[dict[int, list[str]], dict]:
    """A new save's upload: (rank -> files it uploads: its own shard, rank 0 also `.metadata`;
    node -> files its root holds: its ranks' shards, `.metadata`, and its partners' shards when
    `replicas` were made), the holders being where a damaged file is uploaded from instead."""
    assignment: dict[int, list[str]] = {}
    held: dict[int, set[str]] = {}
    for node, ranks in enumerate(topology.nodes):
        held[node] = {METADATA_NAME} & set(manifest.files)
        for rank in ranks:
            files = [shard_name(rank)] + ([METADATA_NAME] if rank == 0 else [])
            assignment[rank] = [f for f in files if f in manifest.files]
            held[node] |= {shard_name(rank)} & set(manifest.files)
    for _src, dst, name in transfers(topology, replicas, manifest) if replicas else ():
        held[topology.node_of(dst)].add(name)
    return assignment, {node: frozenset(files) for node, files in held.items()}


def upload_assignment(choice: Choice, manifest: Manifest, topology: Topology) -> dict[int, list[str]]:
    """Rank -> files it uploads for a resumed upload: each file to a rank of the lowest node
    holding it, spread over that node's ranks."""
    out: dict[int, list[str]] = {r: [] for n in topology.nodes for r in n}
    spread: dict[int, int] = {}
    for name in sorted(manifest.files):
        holders = [n for n in sorted(choice.holders) if name in choice.holders[n]]
        if not holders:
            continue  # the remote holds it (a partial resumed upload is never needed then)
        node = holders[0]
        members = topology.nodes[node]
        index = spread.get(node, 0)
        spread[node] = index + 1
        out[members[index % len(members)]].append(name)
    return out


def read_checkpoint_files(storage: Storage, crc: int) -> tuple[bytes, bytes]:
    """The manifest and `.metadata` bytes of a step directory holding version `crc`."""
    manifest = storage.read(MANIFEST_NAME)
    if zlib.crc32(manifest) != crc:
        where = f"{storage.uri}/{MANIFEST_NAME}"
        raise CheckpointCorruptError(f"{where} changed while the load was choosing it; load again", path=where)
    return manifest, storage.read(METADATA_NAME)


def fetch_files(choice: Choice, local_step: Storage, remote: RemoteTier | None, topology: Topology, group) -> Any:
    """Collective: (manifest bytes, `.metadata` bytes) of the chosen version on every rank,
    read once by the leader of the lowest node holding them, else by rank 0 from the remote."""
    node = choice.source_node
    if node is None:
        assert remote is not None
        step_root = remote.storage.child(step_dir(choice.step))
        return _dist.decide_on_rank0(lambda: read_checkpoint_files(step_root, choice.crc), group)
    return _dist.decide_on(lambda: read_checkpoint_files(local_step, choice.crc), topology.leader(node), group)


__all__ = [
    "Choice",
    "NodeCopy",
    "RemoteUnavailableWarning",
    "SkippedDamagedStepWarning",
    "UploadSkippedWarning",
    "Version",
    "add_remote",
    "choose",
    "fetch_files",
    "gather_versions",
    "warn_all",
    "node_copies",
    "own_files",
    "upload_assignment",
]
