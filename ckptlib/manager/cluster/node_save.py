"""One save into node-local roots: every rank writes its shard to its own node's disk.

No directory is shared between nodes, so the coordinator cannot list every rank's files the
way a single-root commit does (`format.layout.commit`). `NodeLocalSave` is the cluster tier's
`SaveTransaction`:

1. every node's leader prepares its own step directory (debris removed, an overwrite checked,
   the pending marker written), and the ranks agree once, before DCP plans;
2. `dcp.save` with each rank's writer on its node's step directory: each rank writes
   `__{rank}_0.distcp` there; the coordinator writes `.metadata` into node 0's directory and
   builds the manifest (with the commit record: the order of this save among the run's
   commits) without listing anything;
3. the manifest and `.metadata` bytes reach every rank in the receipt DCP broadcasts back
   after its final round anyway (`NodeSaveReceipt`: no round of their own); each leader writes
   `.metadata` (other nodes), checks its own ranks' files by size, makes them durable and
   writes the manifest, byte for byte the coordinator's; the ranks agree. A node whose part
   failed makes every node take its manifest back, so a step is committed on every node of
   the save or on none (a crash in between leaves a node committed that the inventory finds
   incomplete: never resumed, debris for retention);
4. `after_commit` (if any) runs on every rank, each leader for its own root (retention), and
   the ranks agree on it.

A failure anywhere: every leader removes what this save wrote under its root (never a
committed checkpoint of another save), every rank its unfinished shard, and the error is
raised on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptlib._runtime import agree as _dist
from ckptlib._torch import dcp_shims
from ckptlib._version import __version__
from ckptlib.errors import CheckpointCorruptError, CheckpointError
from ckptlib.format.native.deletion import remove_failed_save
from ckptlib.format.native.file_names import describe_file
from ckptlib.format.native.layout import prepare_save_target
from ckptlib.format.native.manifest import (
    MANIFEST_NAME,
    METADATA_NAME,
    PENDING_NAME,
    CommitRecord,
    FileRecord,
    Manifest,
)
from ckptlib.format.native.root import LATEST, step_dir
from ckptlib.format.write.transaction import (
    SaveReceipt,
    SaveTransaction,
    _leave_receipt,
    _on_coordinator,
    unwrap_dcp_error,
)
from ckptlib.manager.cluster.pointers import move_latest_off
from ckptlib.manager.cluster.topology import Topology


@dataclasses.dataclass(frozen=True)
class NodeSaveReceipt(SaveReceipt):
    """The receipt of a node-local save: also the bytes every leader writes."""

    manifest: bytes = b""
    metadata: bytes = b""


class NodeLocalSave(SaveTransaction):
    """A `SaveTransaction` whose `storage` is this rank's node's step directory (see the module
    docstring). `commit_record`: the manifest's commit record. `after_commit()` runs on every
    rank once every node committed; its failures reach every rank."""

    def __init__(self, storage, *, topology: Topology, commit_record: CommitRecord, root=None, **kwargs: Any):
        super().__init__(storage, **kwargs)
        self.topology = topology
        self.commit_record = commit_record
        self.root = root  # the node's root: its `latest` names each step once committed there
        self.manifest_bytes: bytes | None = None  # every rank's, once DCP returned
        self._wrote_manifest = False
        self._moved_latest = False  # whether `_commit_node` moved the root's `latest`
        self._previous_latest: str | None = None  # what it named before

    # -- the steps CkptWriter takes ----------------------------------------------------
    def prepare(self) -> None:
        """Coordinator, in DCP's planning round: nothing left to do (every leader prepared its
        own node's directory before DCP started)."""

    def _prepare_node(self) -> None:
        if self.topology.is_leader:
            if self.fence is not None:  # this node's root lock, still the leader's
                self.fence("overwrite" if self.overwrite else "prepare")
            if self.overwrite and self.root is not None and self.step is not None:
                # a committed copy of the step is replaced: `latest` leaves it first
                move_latest_off(self.root, self.step, whole=False)
            prepare_save_target(self.storage, overwrite=self.overwrite, world_size=self.world_size)
            self.prepared = True

    def commit(self, files: dict[str, FileRecord], metadata: Metadata) -> None:
        """Coordinator, after `.metadata`: build the manifest (written by every leader later)."""
        with _on_coordinator():
            manifest = Manifest(
                world_size=self.world_size,
                files=dict(files),
                step=self.step,
                metadata=self.metadata,
                metrics=self.metrics,
                torch_version=torch.__version__,
                ckptlib_version=__version__,
                commit=self.commit_record,
            )
            plan_seconds = None if self.plan_timing is None else self.plan_timing.global_plan_s
            receipt = NodeSaveReceipt(
                manifest.total_bytes,
                plan_seconds,
                manifest=manifest.to_bytes(),
                metadata=self.storage.read(METADATA_NAME),
            )
        self.files = sorted(files)
        _leave_receipt(metadata, receipt)

    # -- the node commit ----------------------------------------------------------------
    def _commit_node(self, manifest_bytes: bytes, metadata_blob: bytes) -> None:
        """A leader: `.metadata` (nodes other than the coordinator's), its own ranks' files
        checked by size and made durable, then the manifest."""
        if not self.topology.is_leader:
            return
        if self.fence is not None:  # this node's root lock, still the leader's
            self.fence("commit")
        storage = self.storage
        manifest = Manifest.from_bytes(manifest_bytes, f"{storage.uri}/{MANIFEST_NAME}")
        if METADATA_NAME not in storage.list(METADATA_NAME):  # node 0's came from CkptWriter, fsynced
            storage.write(METADATA_NAME, metadata_blob)
        listing = storage.list()
        mine = [f"__{r}_0.distcp" for r in self.topology.nodes[self.topology.node]] + [METADATA_NAME]
        problems = []
        for name in mine:
            record = manifest.files.get(name)
            if record is None:
                continue
            if listing.get(name) != record.size:
                got = "missing" if name not in listing else f"{listing[name]} bytes"
                problems.append(f"{describe_file(name)} is {got}, the manifest says {record.size} bytes")
        if problems:
            raise CheckpointCorruptError(f"{storage.uri}: refusing to commit, " + "; ".join(problems), path=storage.uri)
        storage.sync([], names_only=[n for n in mine if n in manifest.files])  # every file's bytes are durable
        storage.write(MANIFEST_NAME, manifest_bytes)
        self._wrote_manifest = True
        storage.delete([PENDING_NAME])
        if self.root is not None and manifest.step is not None:
            # the newest commit of this root: every other reader of it (a plain manager, `ckpt
            # gc`, `ckpt export ROOT`) then agrees with the tier, also after a rollback
            if self.fence is not None:
                self.fence("move latest to")
            self._previous_latest = self.root.read_pointer(LATEST)
            self.root.set_pointer(LATEST, step_dir(manifest.step))
            self._moved_latest = True

    # -- running it ---------------------------------------------------------------------
    def run(self, save: Callable[[Any], Metadata], group=None) -> int | None:
        """Prepare every node, `save(writer)` (DCP), commit every node, then `after_commit`
        on every rank; after a failure clean up on every rank and raise it (see the module
        docstring)."""
        try:
            _dist.agree(self._prepare_node, group)
            receipt = getattr(save(self._writer()), "storage_data", None)  # what the coordinator broadcast
            if not isinstance(receipt, NodeSaveReceipt):
                raise CheckpointError(f"{self.storage.uri}: the save returned no receipt of its commit")
            self.total_bytes, self.manifest_bytes = receipt.total_bytes, receipt.manifest
            self.global_plan_seconds = receipt.global_plan_seconds
            _dist.agree(lambda: self._commit_node(receipt.manifest, receipt.metadata), group)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, dcp_shims.checkpoint_exception_cls()):
                raise unwrap_dcp_error(exc) from exc
            raise
        if self.after_commit is not None:
            try:
                _dist.agree(self.after_commit, group)
            except BaseException:
                if self.on_failure is not None:
                    self.on_failure()
                raise
        return self.total_bytes

    def _writer(self):
        from ckptlib.format.write.dcp_writer import CkptWriter

        return CkptWriter(self.storage, transaction=self, backend=self.shard_backend)

    def abort(self) -> None:
        """Every rank: its unfinished shard; a leader: what this save wrote under its node's root
        (a manifest it wrote first, so the step is committed on no node), then `on_failure`."""
        if self._moved_latest:  # `latest` back where it was before it named the step taken back
            try:
                if self._previous_latest is None:
                    self.root.delete([LATEST])
                else:
                    self.root.set_pointer(LATEST, self._previous_latest)
                self._moved_latest = False
            except Exception:  # noqa: BLE001 - the save's own error is what the caller raises
                pass
        if self._wrote_manifest:
            try:
                self.storage.delete([MANIFEST_NAME])
                self._wrote_manifest = False
            except Exception:  # noqa: BLE001 - the save's own error is what the caller raises
                pass
        remove_failed_save(
            self.storage, shard=self.unfinished_shard, coordinator=self.topology.is_leader, prepared=self.prepared
        )
        if self.on_failure is not None:
            self.on_failure()


__all__ = ["NodeLocalSave"]
