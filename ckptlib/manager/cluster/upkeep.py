"""The cluster tier's upkeep outside a save: its gc over every root, and the upload that
`wait()` / `close()` make of the newest step left local for want of the remote.

gc reports every deletion, with where it is (the remote's as `<remote uri>/<step dir>`, each
node root's as `node<i>:<root>/<step dir>`: a node's root holds its own files and the replicas
it keeps for its partners in the same step directory), and its dry run decides exactly as the
run. The end-of-job upload keeps the promise of a RemoteUnavailableWarning ("tried again at a
later save, wait() or close()"): `close()` uploads the newest step the remote lacks, or raises
a RemoteLagError naming it, since no later save will.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ckptlib._runtime import agree as _dist
from ckptlib.format.native.manifest import MANIFEST_NAME, Manifest
from ckptlib.format.native.root import step_dir
from ckptlib.manager.cleanup import collect
from ckptlib.manager.cluster.resume import own_files

if TYPE_CHECKING:
    from ckptlib.manager.cluster.cluster_tier import ClusterTier


def tier_gc(tier: ClusterTier, *, dry_run: bool, on_removed) -> list[str]:
    """Collective: the remote's retention (rank 0), then every node's own on its root, the dry
    run deciding as the run (the step the run resumed or saved last protected in both). Every
    step directory (to be) removed, on every rank: the remote's, then node by node."""
    topology = tier.setup()
    removed: list[str] = []
    remote = tier.remote
    if remote is not None:
        names = _dist.decide_on_rank0(lambda: remote.gc(dry_run=dry_run, on_removed=on_removed), tier.group)
        removed = [f"{remote.uri.rstrip('/')}/{name}" for name in names]
    protect = {tier.latest_step} - {None}

    def local() -> list[str]:
        if not topology.is_leader:
            return []
        if dry_run:
            return collect(tier.root, tier.root.uri, tier.retention, protect=protect, dry_run=True)
        tier.lock.take()
        try:
            return collect(tier.root, tier.root.uri, tier.retention, protect=protect, fence=tier.lock.fence)
        finally:
            tier.lock.abandon()

    mine = _dist.agree(local, tier.group)
    by_rank = _dist.all_gather_object((tier.root.uri.rstrip("/"), mine), tier.group)
    for node in range(len(topology.nodes)):
        where, names = by_rank[topology.leader(node)]
        removed += [f"node{node}:{where}/{name}" for name in names]
    return removed


def catch_up_plan(tier: ClusterTier, catch_up: str | None) -> tuple[int, Callable, Callable] | None:
    """Collective where it asks rank 0: (step, manifest_bytes(group), assignment(manifest)) of
    the upload `catch_up` ("wait()" / "close()") makes now, None when there is none. "close()":
    the newest step left local, whatever the wait after a failure; "wait()": only a step whose
    upload was skipped, once that wait is over. Every rank's lag is alike, so is the answer."""
    lag = tier.lag
    if catch_up is None or tier.remote is None or not lag.steps or lag.newest is None:
        return None
    step = lag.newest
    if catch_up != "close()" and (lag.newest_tried or not _dist.decide_on_rank0(lambda: lag.due(step), tier.group)):
        return None
    local = tier.root.child(step_dir(step))
    topology = tier.setup()

    def manifest_bytes(group) -> bytes:  # rank 0's node holds it, as every node does
        return _dist.decide_on_rank0(lambda: local.read(MANIFEST_NAME), group)

    def assignment(manifest: Manifest):
        return own_files(topology, manifest, 0)  # each rank its own files, from its node's root

    return step, manifest_bytes, assignment


__all__ = ["catch_up_plan", "tier_gc"]
