"""The cluster tier a CheckpointManager holds: node-local roots, peer replicas, a remote.

    CheckpointManager("/nvme/run1", keep_last=2, replicas=1,
                      remote=RemoteTier("s3://bucket/run1", keep_last=10))

Each rank passes its own node's local root (the same path on every node of a real cluster;
no directory is shared between nodes). A save:

- blocks only for the local write (`async_save=True`: only for staging): every rank writes its
  shard into its own node's root and every node commits the step (`node_save.NodeLocalSave`),
  then each node's leader applies the local retention to its own root;
- then, in the background on a dedicated gloo group: the replicas (`replication`), then the
  upload, every rank its own files, and one remote commit (`remote_tier`); the next save,
  `wait()`, `gc()` and `close()` wait for it first and raise its failure on every rank.

Every manifest records the save's place in the commit order (`format.manifest.CommitRecord`).
`load()` resumes the newest resumable version in that order (`resume`) from the nearest
intact copy of each file: the rank's own node, else a peer node, else the remote
(`tier_load`). A resumed local step the remote lacks is uploaded afterwards, in the background.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Mapping

from ckptlib._runtime import agree as _dist
from ckptlib._runtime import world
from ckptlib.errors import (
    CheckpointExistsError,
    CopiesExhaustedError,
    DamagedCopyError,
    RankLostError,
    RemoteUnavailableError,
    ReplicationError,
    ReplicationRankLostError,
    StateError,
    UploadError,
    stacklevel_outside_ckptlib,
    warn_scrubbed,
)
from ckptlib.format.native.layout import classify
from ckptlib.format.native.manifest import CommitRecord, Manifest
from ckptlib.format.native.root import StalePointerWarning, committed_steps, step_dir
from ckptlib.manager.cleanup import collect
from ckptlib.manager.cluster.damaged import damaged_by_node, reassign, set_aside, without
from ckptlib.manager.cluster.node_save import NodeLocalSave
from ckptlib.manager.cluster.remote_lag import LagState, RemoteLagReport
from ckptlib.manager.cluster.replication import replicate
from ckptlib.manager.cluster.resume import (
    Choice,
    RemoteUnavailableWarning,
    SkippedDamagedStepWarning,
    UploadSkippedWarning,
    add_remote,
    choose,
    fetch_files,
    gather_versions,
    load_version,
    own_files,
    upload_assignment,
    warn_all,
)
from ckptlib.manager.cluster.topology import FewerReplicasWarning, Topology, detect
from ckptlib.manager.cluster.upkeep import catch_up_plan, tier_gc
from ckptlib.manager.local_budget import LocalBudget, LocalUsage
from ckptlib.manager.lock import RootLock
from ckptlib.manager.single_root import TierSettings
from ckptlib.saving import background_save
from ckptlib.saving.background_save import AsyncSave
from ckptlib.saving.saving import SaveResult, transact
from ckptlib.storage.base import Storage

if TYPE_CHECKING:
    from ckptlib.manager.options import Cluster


#: What a rank lost while the tier takes its inventory (topology, listings, the manifest
#: broadcast) interrupts: the same words on every rank (the roll call's key).
INVENTORY = "the cluster tier's inventory"


class ClusterTier:
    """The tier a CheckpointManager with `cluster=Cluster(...)` holds (`ckptlib.manager.single_root.Tier`)."""

    def __init__(self, root: Storage, settings: TierSettings, cluster: Cluster):
        remote = cluster.remote
        if remote is not None:
            local_path, remote_path = root.local_path(), remote.storage.local_path()
            if local_path is not None and remote_path is not None:
                a, b = os.path.realpath(local_path), os.path.realpath(remote_path)
                if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
                    raise StateError(f"the remote root {remote.uri!r} and the local root {root.uri!r} overlap")
            remote.lock.hold = settings.hold_lock
        self.root = root
        self.settings = settings
        self.retention = settings.retention
        self.remote = remote
        self.replicas = self._replicas_asked = cluster.replicas
        self.node = cluster.node
        self.group = settings.group
        self.topology: Topology | None = None
        self._world: int | None = None  # the world (`_runtime.world`) the topology was found in
        self.lock = RootLock(root, hold=settings.hold_lock)  # this node's root; its leader takes it
        self.budget = LocalBudget(cluster.max_local_bytes, root)
        self._seq: int | None = None  # the largest commit seq seen (None: not looked yet)
        self._latest: int | None = None  # the step last saved or resumed (the parent of the next save)
        self._job: AsyncSave | None = None  # the background pipeline in flight
        self.lag = LagState(cluster.remote_lag)  # steps the remote lacks for want of it
        self._notices: list[str] = []  # warnings of the pipeline, given at the next wait
        self._run = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12]

    @property
    def latest_step(self) -> int | None:  # the step last saved or resumed
        return self._latest

    def path(self, step: int) -> str:
        """With a remote, the step's remote directory; else its directory in this node's root."""
        return self.remote.path(step) if self.remote is not None else f"{self.root.uri.rstrip('/')}/{step_dir(step)}"

    def steps(self) -> list[int]:
        """Committed steps, oldest first: the remote root's, else this node's."""
        return self.remote.steps() if self.remote is not None else committed_steps(self.root)

    def busy(self) -> bool:
        return self._job is not None

    def describe(self) -> str:
        where = repr(self.root.uri)
        return f"{where}, remote={self.remote.uri!r}" if self.remote is not None else where

    # -- collective set-up --------------------------------------------------------------
    def setup(self) -> Topology:
        """This job's nodes (collective, once per world: after `destroy_process_group()` and
        `init_process_group()` the nodes and ranks are found again, and the next save takes
        the inventory again, as a process that joined the new world does)."""
        if self._world != world.generation():
            self.topology, self._seq, self._latest = None, None, None
            self._world = world.generation()
        if self.topology is None:
            with _dist.peer_loss_as_error(INVENTORY, self.group):
                topology = detect(self.root, self.group, self.node)
            self.replicas, why = topology.usable_replicas(self._replicas_asked)
            if why:
                warnings.warn(why, FewerReplicasWarning, stacklevel=stacklevel_outside_ckptlib())
            self.topology = topology
        return self.topology

    def _inventory(self, step: int | None, refuse_unknown: bool = False) -> list[Choice]:
        """Collective: the resumable versions, newest in commit order first (see `resume`),
        warnings issued on every rank; learns the largest commit seq. `refuse_unknown`: an
        unreachable remote while no node holds any step is a RemoteUnavailableError (on
        every rank) instead of "nothing to resume"."""
        topology = self.setup()
        with _dist.peer_loss_as_error(INVENTORY, self.group):
            return self._take_inventory(topology, step, refuse_unknown)

    def _take_inventory(self, topology: Topology, step: int | None, refuse_unknown: bool) -> list[Choice]:
        versions = gather_versions(self.root, topology, self.group)
        remote = self.remote

        def decide():
            unreachable: list[str] = []
            skipped: list[str] = []
            reachable, latest = add_remote(versions, remote, unreachable) if remote else (False, None)
            if refuse_unknown and remote is not None and not reachable and not versions:
                raise RemoteUnavailableError(
                    f"{unreachable[0]} and no node holds a local step: whether a step was committed there is "
                    "unknown, and resuming nothing could retrain it and then overwrite it. Retry once the remote "
                    "answers, or load(..., fresh_start_ok=True) to start from scratch",
                    path=remote.uri,
                )
            chosen = choose(
                versions,
                step,
                where=self.root.uri,
                remote_reachable=reachable,
                remote_latest=latest,
                skipped=skipped,
            )
            seqs = [v.order[1] for v in versions.values() if v.order[0] == 1]
            return chosen, unreachable, skipped, max(seqs, default=0)

        chosen, unreachable, skipped, seq = _dist.decide_on_rank0(decide, self.group)
        warn_all([f"{why}; using the local tiers only" for why in unreachable], RemoteUnavailableWarning)
        warn_all(skipped, SkippedDamagedStepWarning)
        self._seq = max(seq, self._seq or 0)
        return chosen

    # -- the node roots' locks ------------------------------------------------------------
    def _lock_node(self) -> None:
        assert self.topology is not None
        if self.topology.is_leader:
            self.lock.take()

    def _unlock_node(self) -> None:
        """Each leader lets go of its root's lock (unless held), never raising."""
        if self.topology is not None and self.topology.is_leader:
            self.lock.abandon()

    # -- saving -------------------------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any], metadata, metrics, overwrite: bool) -> SaveResult | AsyncSave:
        """Save `step` into every node's root, then replicate and upload in the background.
        The node roots stay locked until the background work (and each node's retention,
        which runs last, off the blocking path) is done."""
        topology = self.setup()
        group = self.group
        if self._seq is None:
            chosen = self._inventory(None)
            self._latest = chosen[0].step if chosen else None
        name = step_dir(step)
        background = self.remote is not None or self.replicas > 0
        # One round: every leader locks its root, and each rank tells whether its node's root
        # (and, rank 0, the remote as last seen) holds the step already.
        here = topology.is_leader and classify(self.root.child(name)) == "committed"
        known = topology.rank == 0 and self.remote is not None and step in self.remote.known_steps
        budget = self.budget.figures(topology.is_leader, state)  # the in-memory tier's bound
        _, rows = _dist.agree_sharing(self._lock_node, [int(here), int(known), *budget], group)
        try:
            self.budget.check([r[2:] for r in rows], topology, self.replicas, group)
            replace = self._replace_decision(step, name, overwrite, any(r[0] for r in rows), any(r[1] for r in rows))
            if replace:  # agreed: said once per job
                _dist.warn_once(replace, StalePointerWarning, group)
            record = CommitRecord(seq=(self._seq or 0) + 1, parent=self._latest, run=self._run, nodes=topology.nodes)
            made: list[NodeLocalSave] = []

            def make(storage, **kwargs):
                made.append(NodeLocalSave(storage, topology=topology, commit_record=record, root=self.root, **kwargs))
                return made[-1]

            if background and self.settings.mode is None:
                background_save.async_group(group)  # collective on first use, so here and not in the thread
            result = transact(
                self.root.child(name),
                state,
                step=step,
                metadata=metadata,
                metrics=metrics,
                overwrite=overwrite or bool(replace),
                group=group,
                mode=self.settings.mode,
                plan_cache=self.settings.plan_cache,
                progress=self.settings.progress,
                after_commit=None if background else (lambda: self._after_node_commit(step)),
                on_failure=self._unlock_node,
                make_transaction=make,
                fence=lambda what: self.lock.fence(f"{what} step {step}"),  # on each leader
            )
        except BaseException:
            self._unlock_node()
            raise
        self._seq = record.seq
        self._latest = step
        if background:
            write = result if isinstance(result, AsyncSave) else None
            self._start(step, lambda _group: made[0].manifest_bytes, write, resumed=None)
        return result

    def _replace_decision(self, step: int, name: str, overwrite: bool, local: bool, remote: bool) -> str | None:
        """Why an existing committed `step` (in a node's root: `local`; on the remote as last
        seen: `remote`) may be replaced (a warning), None when nothing is there;
        CheckpointExistsError for the step last saved or resumed. The same on every rank."""
        where = ([self.root.uri] if local else []) + ([self.remote.uri] if remote and self.remote else [])
        if not where or overwrite:
            return None
        if step == self._latest:
            raise CheckpointExistsError(
                f"step {step} is the newest committed checkpoint of {' and '.join(where)} (pass overwrite=True)",
                path=f"{where[0]}/{name}",
            )
        return (
            f"step {step} is committed under {' and '.join(where)} but is not the step this run resumed or saved "
            f"last ({self._latest}): it was never resumed from (a crash, or a rollback); replacing it"
        )

    def _after_node_commit(self, step: int) -> None:
        """Every rank once every node committed `step` (and, with a remote or replicas, once
        they are done too): each leader applies its root's retention and unlocks it."""
        if self.topology is not None and self.topology.is_leader:
            try:
                collect(self.root, self.root.uri, self.retention, protect={step}, fence=self.lock.fence)
            finally:
                self._unlock_node()

    # -- the background pipeline ----------------------------------------------------------
    def _start(
        self, step: int, manifest_bytes, write: AsyncSave | None, *, resumed, holders=None, catch_up=None
    ) -> None:
        """Run the replicas (a new save) and the upload of `step` in the background on the
        dedicated group; `resumed`: rank -> files, for an upload resumed after a load (or of a
        step left local: `catch_up` names the call, see `wait`), and `holders`: node -> the
        files of its copy that are intact."""
        group = self.group
        bg = background_save.async_group(group)
        topology = self.topology
        assert topology is not None
        local = self.root.child(step_dir(step))

        def pipeline():
            data = manifest_bytes(bg)
            manifest = Manifest.from_bytes(data, f"{local.uri}/ckptlib.json")
            result = failure = None
            replicated = False
            if resumed is None and self.replicas:
                try:
                    with _dist.peer_loss_as_error(f"replication of step {step}", bg, step=step, path=local.uri):
                        replicate(local, manifest, topology, self.replicas, bg)
                    replicated = True
                except RankLostError as exc:
                    raise ReplicationRankLostError(
                        exc.message, ranks=exc.ranks, step=exc.step, path=exc.path, rank=exc.rank
                    ) from exc
                except ReplicationError as exc:
                    failure = exc  # the upload still runs: the remote copy does not need the replicas
            if self.remote is not None:
                if resumed is None:
                    assignment, held = own_files(topology, manifest, self.replicas if replicated else 0)
                elif callable(resumed):
                    assignment, held = resumed(manifest)
                else:
                    assignment, held = resumed, holders or {}
                upload = functools.partial(
                    self._upload, step, data, manifest, local, assignment, held, bg, resumed is not None
                )
                result = self._remote_copy(step, upload, bg, catch_up)
            if failure is not None:
                raise failure
            return result

        def work():
            if write is not None and write.deliver() is None:
                return None  # the write failed (its failure already seen); it unlocked the roots
            if resumed is not None:
                return pipeline()
            try:
                result = pipeline()
            except RankLostError:  # the group is broken: no more collectives
                self._unlock_node()
                raise
            except BaseException:
                with contextlib.suppress(Exception):
                    _dist.agree(lambda: self._after_node_commit(step), bg)
                raise
            _dist.agree(lambda: self._after_node_commit(step), bg)
            return result

        job = AsyncSave(self.remote.uri if self.remote else local.uri, work, started=time.perf_counter())
        self._job = job
        background_save.register(group, job)

    def _upload(self, step, data, manifest, local, assignment, holders, group, resumed: bool) -> SaveResult:
        """Collective: upload `step`, each rank its `assignment`; a node copy found damaged on
        the way is set aside and its file uploaded from another node's copy (`damaged`)."""
        assert self.remote is not None and self.topology is not None
        rank = self.topology.rank
        while True:
            try:
                return self.remote.upload(step, data, local, assignment.get(rank, []), group, resumed=resumed)
            except DamagedCopyError as exc:
                if exc.rank == rank:
                    set_aside(local, exc.file, manifest)
                assignment, holders = reassign(exc, assignment, holders, self.topology)
                resumed = True  # what the failed attempt uploaded completely stays

    def _remote_copy(self, step: int, upload, group, catch_up: str | None = None) -> SaveResult | None:
        """Collective: `upload()` under the remote-lag policy (`remote_lag.LagState.attempt`);
        a step left local is warned of at the next wait. `catch_up`: tried whatever the wait
        after a failure; "close()": a failure is a RemoteLagError."""
        assert self.remote is not None
        final = catch_up if catch_up == "close()" else None
        result, notice = self.lag.attempt(self.remote.uri, step, upload, group, force=catch_up is not None, final=final)
        if notice is not None:
            self._notices.append(notice)
        return result

    def local_usage(self) -> LocalUsage | None:
        return self.budget.report() if self.budget.path is not None else None

    def remote_lag(self) -> RemoteLagReport | None:
        """The steps not uploaded yet (no collective); None without a remote."""
        return None if self.remote is None else self.lag.report()

    def wait(self, timeout: float | None = None, *, catch_up: str | None = None) -> Any:
        """Wait for the background pipeline: its result, its failure raised once, None if none
        (a step left local for want of the remote: RemoteUnavailableWarning, here).

        `catch_up` ("wait()" / "close()", the manager's public calls; collective then): the
        upload of the newest step left local that `upkeep.catch_up_plan` picks, too, within
        `timeout` in all; after "close()" a failure of it is a RemoteLagError naming the step."""
        started = time.monotonic()
        result = self._deliver(timeout)
        plan = catch_up_plan(self, catch_up)
        if plan is None:
            return result
        step, manifest_bytes, assignment = plan
        self._start(step, manifest_bytes, None, resumed=assignment, catch_up=catch_up)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        return self._deliver(left) or result

    def _deliver(self, timeout: float | None) -> Any:
        job = self._job
        if job is None:
            return None
        try:
            return job.deliver(timeout)
        finally:
            if job.done():
                self._job = None
                notices, self._notices = self._notices, []
                for text in notices:
                    warn_scrubbed(text, RemoteUnavailableWarning)

    # -- loading ------------------------------------------------------------------------
    def load(self, state: Mapping[str, Any], step: int | None, kwargs: dict[str, Any], *, fresh_start_ok=False):
        """Collective: load the newest resumable version (of `step`) from the nearest copies;
        None when there is nothing to resume (known only when the remote answered or some node
        holds a step: else a RemoteUnavailableError, unless `fresh_start_ok`). A version no
        intact copy is left of at read time is skipped with a warning for the next one. Then,
        in the background, the version loaded is uploaded if the remote lacks it and it is newer
        than the remote `latest`."""
        topology = self.setup()
        chosen = self._inventory(step, refuse_unknown=not fresh_start_ok)
        for index, choice in enumerate(chosen):
            local = self.root.child(step_dir(choice.step))
            remote = self.remote.storage.child(step_dir(choice.step)) if self.remote is not None else None
            with _dist.peer_loss_as_error(INVENTORY, self.group, step=choice.step):
                manifest_bytes, metadata_bytes = fetch_files(choice, local, self.remote, topology, self.group)
            try:
                result = load_version(
                    choice, manifest_bytes, metadata_bytes, topology, local, remote, state, self.group, kwargs
                )
            except CopiesExhaustedError as exc:
                if index + 1 == len(chosen):
                    raise
                warn_all(
                    [
                        f"step {choice.step} has no intact copy of a file left ({exc}); loading step "
                        f"{chosen[index + 1].step}"
                    ],
                    SkippedDamagedStepWarning,
                )
                continue
            # every source this tier has is named, zeros included: {"local": ..., "remote": ...}
            sources = ("local", "remote") if self.remote is not None else ("local",)
            result.bytes_by_source = {**dict.fromkeys(sources, 0), **result.bytes_by_source}
            if result.step is None:  # a step directory written without step=: the step its name gives
                result.step = choice.step
            self._latest = choice.step
            manifest = Manifest.from_bytes(manifest_bytes, f"{local.uri}/ckptlib.json")
            damaged = damaged_by_node(result.unusable_copies, topology)
            if damaged:  # never trusted again: not by the upload below, nor by a later inventory
                if topology.is_leader:
                    for name in sorted(damaged.get(topology.node, ())):
                        set_aside(local, name, manifest)
                choice = dataclasses.replace(choice, holders=without(choice.holders, damaged))
            if self._needs_upload(choice, manifest):
                assignment = upload_assignment(choice, manifest, topology)
                data = manifest_bytes
                self._start(choice.step, lambda _group: data, None, resumed=assignment, holders=choice.holders)
            return result
        return None

    def _needs_upload(self, choice: Choice, manifest: Manifest) -> bool:
        """A version newer than the remote `latest`: one the remote lacks (warned and left when
        some file of it has no intact node copy left), or holds (a cut before `latest` moved).
        One the remote could not be asked about is left local: `close()` tries it (`upkeep`)."""
        if self.remote is not None and not choice.remote_reachable and not choice.remote:
            why = UploadError(f"{self.remote.uri}: unreachable when step {choice.step} was resumed")
            self.lag.left_local(choice.step, why, backoff=False)
        newer = choice.remote_latest is None or choice.order > choice.remote_latest
        if not (self.remote is not None and choice.remote_reachable and newer):
            return False
        if choice.remote:
            return True  # committed there already: the upload only moves `latest` to it
        unheld = sorted(name for name in manifest.files if not any(name in h for h in choice.holders.values()))
        if unheld:
            where = f"step {choice.step} is not uploaded to {self.remote.uri}: no node holds an intact copy of "
            warn_all([where + ", ".join(unheld[:10])], UploadSkippedWarning)
        return not unheld

    def latest(self) -> int | None:
        chosen = self._inventory(None)
        return chosen[0].step if chosen else None

    # -- gc and close ---------------------------------------------------------------------
    def gc(self, *, dry_run: bool, on_removed) -> list[str]:
        """Collective: every root's retention, every deletion reported (`upkeep.tier_gc`)."""
        return tier_gc(self, dry_run=dry_run, on_removed=on_removed)

    def close(self) -> None:
        """Release the locks this process holds (no collective); LockedError for one lost while
        held, after releasing the other."""
        try:
            self.lock.close()
        finally:
            if self.remote is not None:
                self.remote.close()


__all__ = ["ClusterTier"]
