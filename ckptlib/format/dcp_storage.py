"""ckptlib's writer and reader as DCP storage objects that a user's own `dcp.save`,
`dcp.async_save` and `dcp.load` drive (the public face is `ckptlib.dcp`).

`DropInWriter` is a `CkptWriter` whose `SaveTransaction` is made for each save, inside DCP's
own rounds: `set_up_storage_writer` opens it (the target's URI from the constructor or the
call's `checkpoint_id`, through `reset`), the coordinator's `prepare_global_plan` prepares the
target before any rank writes, every rank streams its shard with checksums, and the
coordinator's `finish` writes `.metadata` and commits the manifest last. There is no ckptlib
call around DCP's to clean up after a failure, so the transaction is `self_cleaning`: a
rank's write failure travels to the coordinator with its results, and the coordinator,
knowing every rank stopped writing, removes the save and raises the failure (naming the
rank) through DCP. A failure before any write leaves nothing; a rank that dies leaves debris
that the next save there removes and that no load accepts (the pending marker).

`DropInReader` reads any checkpoint ckptlib reads (`source.inspect_checkpoint`): manifest and
`.metadata` checked, every item verified, DCP extensions decoded, object pickles refused
unless `trusted` (in the reader itself: DCP's own planner unpickles with weights_only=False).
DCP calls `read_metadata` on every rank and turns an exception there into an AssertionError
of its own, so a failure is held and raised from `set_up_storage_reader` instead: the
caller's CheckpointException then carries ckptlib's error (`UnsupportedError`,
`CheckpointCorruptError`...), not DCP's text.

Both pickle (DCP's process-based `async_save` sends the writer to another process) and hold
only a URI and settings until a save or load sets them up. `validate_checkpoint_id` accepts
what they serve: local paths, `file://`, and `s3://`, `gs://`, `az://` where that backend's
client library is installed.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Any
from urllib.parse import urlparse

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointError, StateError, UnsupportedError
from ..storage import Storage, as_storage
from .dcp_writer import CkptWriter
from .manifest import METADATA_MARKER
from .source import inspect_checkpoint, open_reader
from .stream_transforms import Transforms
from .transaction import SaveTransaction

# The client library each remote scheme needs (the `ckptlib[s3]`, `[gcs]`, `[azure]` extras).
_SCHEME_MODULES = {"s3": "boto3", "gs": "google.cloud.storage", "az": "azure.storage.blob"}


def serves(checkpoint_id: Any) -> bool:
    """Whether ckptlib's storage serves `checkpoint_id`: a local path (str or PathLike),
    `file://` on this host, or s3/gs/az with its client installed."""
    if isinstance(checkpoint_id, os.PathLike):
        checkpoint_id = os.fspath(checkpoint_id)
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        return False
    if "://" not in checkpoint_id:
        return True
    parsed = urlparse(checkpoint_id)
    if parsed.scheme == "file":
        return parsed.netloc in ("", "localhost")
    module = _SCHEME_MODULES.get(parsed.scheme)
    if module is None or not parsed.netloc:
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _location(uri: Any) -> str | Storage | None:
    if uri is None or isinstance(uri, str) or not isinstance(uri, os.PathLike):
        return uri
    return os.fspath(uri)


def _uri_of(location: str | Storage | None) -> str | None:
    return location.uri if location is not None and not isinstance(location, str) else location


def _no_location(what: str) -> StateError:
    return StateError(
        f"ckptlib.dcp.{what} has no checkpoint location: pass one to ckptlib.dcp.{what}(uri) or as checkpoint_id="
    )


class DropInWriter(CkptWriter):
    """A DCP StorageWriter that saves a committed ckptlib checkpoint (see the module)."""

    def __init__(
        self,
        uri: str | os.PathLike | Storage | None = None,
        *,
        overwrite: bool = True,
        transforms: Transforms | None = None,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
    ):
        self.location = _location(uri)
        self.overwrite = overwrite
        self.step, self.user_metadata, self.metrics = step, dict(metadata or {}), dict(metrics or {})
        super().__init__(None, transaction=None, transforms=transforms, save_id=str(uuid.uuid4()))  # type: ignore[arg-type]

    @property
    def checkpoint_id(self) -> str | None:
        """Where the next save goes (DCP names it in its logs)."""
        return _uri_of(self.location)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.location = _location(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise UnsupportedError(
                "ckptlib.dcp.writer needs DCP's collectives (use_collectives=False writes per-rank metadata with no "
                "coordinator to commit a manifest)"
            )
        if self.location is None:
            raise _no_location("writer")
        self.storage = as_storage(self.location)
        self.transaction = SaveTransaction(
            self.storage,
            world_size=1,  # the coordinator learns it from the plans (prepare_global_plan)
            step=self.step,
            metadata=self.user_metadata,
            metrics=self.metrics,
            overwrite=self.overwrite,
            self_cleaning=True,
        )
        self.file_records = {}
        super().set_up_storage_writer(is_coordinator)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.transaction.world_size = len(plans)
        return super().prepare_global_plan(plans)

    def storage_meta(self) -> StorageMeta | None:
        # DCP asks before set_up_storage_writer: from the location, not the storage.
        meta = StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)
        meta.modules = [*(getattr(meta, "modules", None) or []), METADATA_MARKER]
        return meta

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return serves(checkpoint_id)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(storage=None, transaction=None, file_records={})  # made again by the next set-up
        return state


class DropInReader(StorageReader):
    """A DCP StorageReader over any checkpoint ckptlib reads (see the module)."""

    def __init__(
        self,
        uri: str | os.PathLike | Storage | None = None,
        *,
        verify: bool = True,
        trusted: bool = False,
        transforms: Transforms | None = None,
        prefix: str | None = None,
    ):
        super().__init__()
        self.location = _location(uri)
        self.verify, self.trusted, self.prefix = verify, trusted, prefix
        self.transforms = transforms or Transforms()
        self.load_id = str(uuid.uuid4())
        self._clear()

    def _clear(self) -> None:
        self._info: Any = None
        self._held: CheckpointError | None = None
        self._reader: Any = None

    @property
    def checkpoint_id(self) -> str | None:
        return _uri_of(self.location)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.location = _location(checkpoint_id)
        self.load_id = str(uuid.uuid4())
        self._clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._clear()
        try:
            if self.location is None:
                raise _no_location("reader")
            self._info = inspect_checkpoint(
                as_storage(self.location), verify=self.verify, prefix=self.prefix, trusted=self.trusted
            )
        except CheckpointError as exc:
            self._held = exc  # raised by set_up_storage_reader, in DCP's same round (see the module)
            return Metadata(state_dict_metadata={})
        metadata = self._info.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._held is not None:
            raise self._held
        if self._info is None:  # DCP always reads the metadata first; a caller that did not
            self.read_metadata()
            if self._held is not None:
                raise self._held
        self._reader, _ = open_reader(
            as_storage(self.location),
            info=self._info,
            verify=self.verify,
            prefix=self.prefix,
            trusted=self.trusted,
            transforms=self.transforms,
        )
        self._reader.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self._reader.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return self._reader.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        return self._reader.read_data(plan, planner)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return serves(checkpoint_id)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_info": None, "_held": None, "_reader": None}


__all__ = ["DropInReader", "DropInWriter", "serves"]
