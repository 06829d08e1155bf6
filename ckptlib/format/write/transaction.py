"""One save into a checkpoint directory, committed or nothing: the object that owns it.

`SaveTransaction` is what every native save goes through (`ckptlib.save`, `async_save`, the
manager, `convert --to dcp`). It runs inside DCP's own collective rounds, through the
`CkptWriter` it hands to `dcp.save`, so preparing and committing cost no collective of their
own:

- `prepare()`: on the coordinator, in DCP's planning round, before any rank writes: the
  `fence` hook confirms the writer may still write there (the manager's root lock), then the
  target is made ready (`layout.prepare_save_target`: debris removed, an overwrite checked,
  the pending marker written);
- `open_shard(name)`: every rank writes its shard file through it (a shard it started and
  did not finish is known, for the cleanup);
- `commit(files)`: on the coordinator, in DCP's final round, after `.metadata`: `fence` again,
  then the manifest is written last (`layout.commit_manifest`);
- then the `after_commit` hook runs on rank 0 once every rank returned from DCP, its outcome
  shared with every rank (`_dist.decide_on_rank0`): the manager moves `latest` and applies
  retention there;
- `abort()`: on every rank after a failure: what this save wrote is removed (a full disk
  does not stay full), a committed checkpoint never; then the `on_failure` hook runs.

Errors raised on the coordinator reach every rank through DCP (`_on_coordinator` makes them
portable); `run` turns DCP's gathered CheckpointException back into the ckptlib error
(`unwrap_dcp_error`). The checkpoint's size reaches every rank in the Metadata DCP
broadcasts back after the commit: once `.metadata` is written, the coordinator leaves only a
`SaveReceipt` in it (`_leave_receipt`), so that broadcast is not every tensor's chunks again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

from torch.distributed.checkpoint.metadata import Metadata

from ckptlib._runtime import agree as _dist
from ckptlib._torch import dcp_shims
from ckptlib.errors import CheckpointError, RankInterruptedError
from ckptlib.format.native.deletion import remove_failed_save
from ckptlib.format.native.layout import commit_manifest, prepare_save_target
from ckptlib.format.native.manifest import METADATA_NAME, FileRecord
from ckptlib.format.write.dcp_writer import CkptWriter, ShardBackend
from ckptlib.format.write.plan_cache import PlanTiming
from ckptlib.storage.base import Storage


@dataclasses.dataclass(frozen=True)
class SaveReceipt:
    """What every rank learns of a committed save (DCP broadcasts it back from the coordinator):
    its size and the coordinator's global-planning seconds."""

    total_bytes: int
    global_plan_seconds: float | None = None


def unwrap_dcp_error(exc: BaseException) -> CheckpointError:
    """Turn DCP's CheckpointException (failures gathered from all ranks) into a ckptlib error.

    An interrupt (KeyboardInterrupt, SystemExit) is raised again as itself on the rank that got
    it (short: no chain of DCP's wrappers); the other ranks get a RankInterruptedError naming it,
    not a rank that "disappeared"."""
    failures = [
        (rank, inner.interrupt if isinstance(inner, _dist.InterruptedCollective) else inner)
        for rank, inner in dcp_shims.dcp_failures(exc)
    ]
    interrupted = [(rank, inner) for rank, inner in failures if isinstance(inner, (KeyboardInterrupt, SystemExit))]
    if interrupted:
        me = _dist.get_rank()
        for rank, inner in interrupted:
            if rank == me:
                raise inner.with_traceback(None) from None
        ranks = [rank for rank, _ in interrupted]
        kinds = ", ".join(f"rank {rank} was interrupted ({type(inner).__name__})" for rank, inner in interrupted)
        return RankInterruptedError(f"{kinds}: the collective call stopped on every rank", ranks=ranks, rank=me)
    for rank, inner in failures:
        if isinstance(inner, CheckpointError):
            if inner.rank is None:  # raised on that rank (a decision for every rank has its rank set)
                inner.rank = rank
                if not inner.message.startswith("rank "):
                    inner.message = f"rank {rank}: {inner.message}"
                    inner.args = (inner.message,)
            return inner
    parts = [f"rank {rank}: {type(inner).__name__}: {inner}" for rank, inner in failures]
    return CheckpointError("; ".join(parts) or str(exc), rank=failures[0][0] if failures else None)


@contextlib.contextmanager
def _on_coordinator() -> Iterator[None]:
    """A step the coordinator takes inside a DCP collective, deciding for every rank: a
    CheckpointError it raises reaches every rank as it is (no per-rank prefix); any other
    exception as a CheckpointError "rank N: Type: message" (DCP pickles it to every rank)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised, portable, on every rank by DCP
        error = _dist.portable_error(exc, _dist.get_rank())
        if error is exc:
            raise
        raise error from exc


class SaveTransaction:
    """A save of `world_size` ranks into `storage`, committed with a manifest (`step`, user
    `metadata` and `metrics`) or not at all. `overwrite`: replace a committed checkpoint there.

    Hooks: `fence(what)` runs on the coordinator before each irreversible step ("overwrite" or
    "prepare": removing what the target holds; "commit": writing the manifest) and raises to
    stop it (the manager's lock lost: `RootLock.fence`); `after_commit()` runs on rank 0 once
    the save committed (its errors reach every
    rank; the checkpoint stays committed); `on_failure()` runs on every rank after a failed
    save was cleaned up, or after `after_commit` failed. `shard_backend`: where this rank's
    shard is encoded and written (`dcp_writer.ShardBackend`; None: in the calling thread).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        world_size: int,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        overwrite: bool = False,
        after_commit: Callable[[], None] | None = None,
        on_failure: Callable[[], None] | None = None,
        shard_backend: ShardBackend | None = None,
        self_cleaning: bool = False,
        fence: Callable[[str], None] | None = None,
    ):
        self.storage = storage
        self.world_size = world_size
        self.step = step
        self.metadata = dict(metadata or {})
        self.metrics = dict(metrics or {})
        self.overwrite = overwrite
        self.after_commit = after_commit
        self.on_failure = on_failure
        self.fence = fence
        self.shard_backend = shard_backend  # where the shard is written (None: this thread)
        # For the cleanup of a failed save: whether this process coordinates the save (DCP
        # tells the writer), whether its prepare step ran, and the shard file this rank
        # started and did not finish (None once it is complete).
        self.is_coordinator = False
        self.prepared = False
        self.unfinished_shard: str | None = None
        self.total_bytes: int | None = None
        # The coordinator's planner sets it (`CkptSavePlanner.timing.global_plan_s`); every
        # rank learns it from the receipt.
        self.plan_timing: PlanTiming | None = None
        self.global_plan_seconds: float | None = None
        self.files: list[str] = []  # the files the manifest lists (on the coordinator, once committed)
        # Driven by a user's own dcp.save (ckptlib.dcp.writer), with no `run` around it: a rank's
        # write failure travels to the coordinator with its results, and the coordinator, which
        # then knows every rank stopped writing, removes the save in `finish` and raises it.
        self.self_cleaning = self_cleaning

    # -- the steps CkptWriter takes ----------------------------------------------------
    def prepare(self) -> None:
        """Coordinator, before any rank writes: make the target ready for this save."""
        with _on_coordinator():
            if self.fence is not None:
                self.fence("overwrite" if self.overwrite else "prepare")
            prepare_save_target(self.storage, overwrite=self.overwrite, world_size=self.world_size)
        self.prepared = True

    @contextlib.contextmanager
    def open_shard(self, name: str) -> Iterator[Any]:
        """This rank's stream for shard file `name`; complete once the block ends without error."""
        with self.writing_shard(name), self.storage.open_writer(name) as stream:
            yield stream

    @contextlib.contextmanager
    def writing_shard(self, name: str) -> Iterator[None]:
        """Shard file `name` is being written (by this process or its writer process): a
        failure before the block ends leaves it for `abort()` to remove."""
        self.unfinished_shard = name
        yield
        self.unfinished_shard = None

    def commit(self, files: dict[str, FileRecord], metadata: Metadata) -> None:
        """Coordinator, after `.metadata` is written: the manifest, last. `metadata` (what DCP
        broadcasts back to every rank) then becomes this save's receipt."""
        with _on_coordinator():
            if self.fence is not None:
                self.fence("commit")
            commit_manifest(
                self.storage,
                files,
                world_size=self.world_size,
                step=self.step,
                metadata=self.metadata,
                metrics=self.metrics,
                synced=(METADATA_NAME,),  # CkptWriter streams it through open_writer, which fsyncs
            )
        self.files = sorted(files)
        self.total_bytes = sum(record.size for record in files.values())
        self.global_plan_seconds = None if self.plan_timing is None else self.plan_timing.global_plan_s
        if not self.self_cleaning:  # a user's dcp.save returns this Metadata: it stays whole
            _leave_receipt(metadata, SaveReceipt(self.total_bytes, self.global_plan_seconds))

    # -- a save driven by a user's dcp.save (self_cleaning) ------------------------------
    def portable_failure(self, exc: BaseException) -> CheckpointError:
        """This rank's write failure, to travel to the coordinator with its results."""
        return _dist.portable_error(exc, _dist.get_rank())

    def fail(self, failures: list[tuple[int, CheckpointError]]) -> None:
        """Coordinator, in `finish`: ranks' writes failed; remove the save, raise the first."""
        self.abort()
        rank, error = failures[0]
        if error.rank is None:
            error.rank = rank
        raise error

    @contextlib.contextmanager
    def cleaning_up_on_failure(self) -> Iterator[None]:
        """Coordinator, around the commit of a self-cleaning save: a failure removes the save."""
        try:
            yield
        except BaseException:
            if self.self_cleaning:
                self.abort()
            raise

    # -- running it ---------------------------------------------------------------------
    def run(self, save: Callable[[Any], Metadata], group=None) -> int | None:
        """Run `save(writer)` (a `dcp.save` on `group` through a CkptWriter of this
        transaction), then `after_commit`; return the committed checkpoint's size. After a
        failure, `abort()` on this rank and raise it (DCP's gathered failures as the ckptlib
        error they carry)."""
        try:
            metadata = save(CkptWriter(self.storage, transaction=self, backend=self.shard_backend))
        except BaseException as exc:
            self.abort()
            if isinstance(exc, dcp_shims.checkpoint_exception_cls()):
                raise unwrap_dcp_error(exc) from exc
            raise
        if self.total_bytes is None:  # not the coordinator: the receipt it broadcast
            received = getattr(metadata, "storage_data", None)
            if isinstance(received, SaveReceipt):
                self.total_bytes, self.global_plan_seconds = received.total_bytes, received.global_plan_seconds
        if self.after_commit is not None:
            try:
                _dist.decide_on_rank0(self.after_commit, group)
            except BaseException:
                if self.on_failure is not None:
                    self.on_failure()
                raise
        return self.total_bytes

    def abort(self) -> None:
        """Every rank, after a failure: remove what this save wrote (best effort, never a
        committed checkpoint), then `on_failure`."""
        remove_failed_save(
            self.storage, shard=self.unfinished_shard, coordinator=self.is_coordinator, prepared=self.prepared
        )
        if self.on_failure is not None:
            self.on_failure()


def _leave_receipt(metadata: Metadata, what: SaveReceipt) -> None:
    """Leave only `what` in the Metadata of a save whose `.metadata` is written: DCP returns
    this object from `dcp.save` on every rank, pickled, and nothing else reads it."""
    metadata.state_dict_metadata = {}
    metadata.planner_data = None
    metadata.storage_meta = None
    metadata.storage_data = what


__all__ = ["SaveReceipt", "SaveTransaction", "unwrap_dcp_error"]
