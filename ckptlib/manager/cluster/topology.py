"""Which ranks share a node's local root: the layout a cluster tier saves by.

A node here is a *distinct local root*: the ranks of one machine (torchrun's `GROUP_RANK`,
or an explicit `node=` key, else the host name), merged with every other machine that turns
out to see the same directory (a shared filesystem). Nodes are numbered densely in order of
their lowest global rank, and the lowest rank of a node is its leader (never `LOCAL_RANK ==
0`: `--virtual-local-rank` makes that 0 on every rank).

Node indices decide only where *this save's* bytes go (each rank's own shard into its own
node's root; replicas to the partner nodes). `GROUP_RANK` can change across restarts (the
c10d rendezvous numbers agents by their descriptors), so where a step's bytes are is learned
at load time from what each node finds in its own root, never from a recorded index.

The partner rule (`replicas=R`): node i's files are also written to nodes (i+1) mod G, ...,
(i+R) mod G (G nodes in this save); the file of the rank at position p within node i goes to
the rank at position min(p, size - 1) of the partner node. R must be < G.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from typing import Any

from ckptlib._runtime import agree as _dist
from ckptlib.errors import StateError
from ckptlib.storage.base import Storage

TOKEN_PREFIX = "ckptlib.node-"


class FewerReplicasWarning(UserWarning):
    """The job has too few nodes for the replicas asked for; it keeps one per other node."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """This rank's place among the nodes of its process group (group ranks throughout)."""

    rank: int
    nodes: tuple[tuple[int, ...], ...]  # the ranks of each node, ascending; nodes by lowest rank

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        for index, ranks in enumerate(self.nodes):
            if rank in ranks:
                return index
        raise StateError(f"rank {rank} is on no node of {self.nodes}")

    def leader(self, node: int) -> int:
        return self.nodes[node][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader(self.node)

    def partners(self, node: int, replicas: int) -> list[int]:
        """The nodes that hold replicas of `node`'s files (the ring rule)."""
        count = len(self.nodes)
        return [(node + k) % count for k in range(1, replicas + 1)]

    def replica_rank(self, rank: int, partner: int) -> int:
        """The rank of node `partner` that keeps the replica of `rank`'s files."""
        position = self.nodes[self.node_of(rank)].index(rank)
        members = self.nodes[partner]
        return members[min(position, len(members) - 1)]

    def usable_replicas(self, replicas: int) -> tuple[int, str | None]:
        """The replicas this job can keep (at most one per other node), and why fewer, if so."""
        if replicas < len(self.nodes):
            return replicas, None
        usable = len(self.nodes) - 1
        return usable, (
            f"replicas={replicas} needs at least {replicas + 1} nodes with their own local root; this job has "
            f"{len(self.nodes)} ({_describe(self.nodes)}): keeping {usable} replica{'s' if usable != 1 else ''}"
        )


def _describe(nodes: tuple[tuple[int, ...], ...]) -> str:
    return "; ".join(f"node {i}: ranks {', '.join(map(str, n))}" for i, n in enumerate(nodes))


def node_key(node: Any = None) -> str:
    """This process's machine: the explicit `node`, else torchrun's GROUP_RANK, else the host name."""
    if node is not None:
        return f"node:{node}"
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank not in (None, ""):
        return f"group:{group_rank}"
    return f"host:{socket.gethostname()}"


def _by_lowest_rank(keys: list[Any]) -> tuple[tuple[int, ...], ...]:
    members: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys):
        members.setdefault(key, []).append(rank)
    return tuple(sorted((tuple(r) for r in members.values()), key=lambda ranks: ranks[0]))


def detect(root: Storage, group=None, node: Any = None) -> Topology:
    """The topology of `group`, whose ranks each pass their own node's local `root`.

    Collective (four small rounds, once per manager): the machines by `node_key`, then every
    machine's leader leaves a token in its root and reads which tokens it sees, so machines
    that share one directory (a shared filesystem) count as one node and never write the
    same step directory twice. The tokens are removed at once."""
    rank = _dist.get_rank(group)
    world = _dist.get_world_size(group)
    keys = _dist.all_gather_object(node_key(node), group)
    machines = _by_lowest_rank(keys)
    if len(machines) == 1:
        return Topology(rank, (tuple(range(world)),))
    leads = {m[0] for m in machines}
    token = uuid.uuid4().hex
    _dist.agree(lambda: root.write(TOKEN_PREFIX + token, b"", durable=False) if rank in leads else None, group)
    try:
        seen = _dist.agree(
            lambda: {n[len(TOKEN_PREFIX) :] for n in root.list(TOKEN_PREFIX)} if rank in leads else None, group
        )
        views = _dist.all_gather_object((token, seen) if rank in leads else None, group)
    finally:
        _dist.agree(lambda: root.delete([TOKEN_PREFIX + token]) if rank in leads else None, group)
    # machine m shares a root with machine n when n's leader saw m's token
    owner = {views[m[0]][0]: i for i, m in enumerate(machines)}
    parent = list(range(len(machines)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, m in enumerate(machines):
        for tok in views[m[0]][1]:
            j = owner.get(tok)
            if j is not None:
                parent[find(i)] = find(j)
    merged = [find(machines.index(next(m for m in machines if r in m))) for r in range(world)]
    return Topology(rank, _by_lowest_rank(merged))


__all__ = ["FewerReplicasWarning", "Topology", "detect", "node_key"]
