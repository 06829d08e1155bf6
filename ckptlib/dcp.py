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

import os
from typing import Any, Sequence

from .format.dcp_storage import DropInReader as Reader
from .format.dcp_storage import DropInWriter as Writer
from .format.manifest import check_metadata_json, check_metrics
from .format.stream_transforms import Transforms
from .steps import check_step
from .storage import Storage


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
