"""ckptlib as the storage layer of your own `torch.distributed.checkpoint` calls.

    import torch.distributed.checkpoint as dcp
    import ckptlib.dcp

    dcp.save(state_dict, storage_writer=ckptlib.dcp.writer("s3://bucket/run/step-100"))
    dcp.async_save(state_dict, storage_writer=ckptlib.dcp.writer(), checkpoint_id="/ckpt/step-200")
    dcp.load(state_dict, storage_reader=ckptlib.dcp.reader("gs://bucket/run/step-100"))

Any `dcp.save`, `dcp.async_save` (thread or process executor) and `dcp.load` accepts them, with
any planner, on every backend ckptlib has (local paths, `file://`, `s3://`, `gs://`, `az://`).
What a save through `writer` writes is a committed ckptlib checkpoint: the shard files and
`.metadata` that plain DCP writes (so `FileSystemReader` reads it), every item checksummed,
and the manifest written last, inside DCP's own collective rounds; a failed save is removed
(the error names the rank). `reader` reads any checkpoint `ckptlib.load` reads, checking what
`ckptlib.load` checks. A `checkpoint_id=` given to the DCP call replaces the URI (DCP calls
`reset`); each save records a fresh `save_id` and each load a fresh `load_id` in DCP's
`StorageMeta`, as DCP's own writer and reader do. Details and what is refused: docs/dcp.md.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Any, Sequence
from urllib.parse import urlparse

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptlib.errors import CheckpointError, StateError, UnsupportedError
from ckptlib.format.native.manifest import METADATA_MARKER, check_metadata_json, check_metrics
from ckptlib.format.native.root import check_step
from ckptlib.format.native.stream_transforms import Transforms
from ckptlib.format.source import inspect_checkpoint, open_reader
from ckptlib.format.write.dcp_writer import CkptWriter
from ckptlib.format.write.transaction import SaveTransaction
from ckptlib.storage import as_storage
from ckptlib.storage.base import Storage

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


Reader = DropInReader
Writer = DropInWriter


def writer(
    uri: str | os.PathLike | Storage | None = None,
    *,
    overwrite: bool = True,
    extensions: Sequence[Any] | None = None,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
) -> Writer:
    """A DCP StorageWriter saving a committed ckptlib checkpoint at `uri` (or at the
    `checkpoint_id` of the DCP call).

    `overwrite=True` (DCP's FileSystemWriter default) replaces a checkpoint already there, as
    `ckptlib.save(..., overwrite=True)` does: only a checkpoint's own files, never a directory
    holding anything else (OverwriteRefusedError). `extensions`: DCP stream extensions each
    item is written through (`ZStandard()`, or your own `StreamTransformExtension`), recorded
    per item as DCP records them. `step`, `metadata` (JSON) and `metrics` go into the manifest.
    """
    return Writer(
        uri,
        overwrite=overwrite,
        transforms=Transforms(extensions),
        step=None if step is None else check_step(step),
        metadata=check_metadata_json(metadata),
        metrics=check_metrics(metrics),
    )


def reader(
    uri: str | os.PathLike | Storage | None = None,
    *,
    verify: bool = True,
    trusted: bool = False,
    extension_registry: Any | None = None,
    prefix: str | None = None,
) -> Reader:
    """A DCP StorageReader over the checkpoint at `uri` (or at the `checkpoint_id` of the DCP
    call): ckptlib or plain DCP, a torch.save file, safetensors, v0.

    `verify`: check every item read against the manifest's checksums. `trusted=False` refuses
    objects whose unpickling would run code (UnsafeCheckpointError), whatever the planner.
    `extension_registry`: DCP's `ExtensionRegistry` for custom stream extensions (zstd is
    always known). `prefix`: the key foreign formats' flat tensor names are nested under
    (none: as stored).
    """
    return Reader(
        uri, verify=verify, trusted=trusted, transforms=Transforms(registry=extension_registry), prefix=prefix
    )


__all__ = ["Reader", "Writer", "reader", "writer"]
