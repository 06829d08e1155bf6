"""DCP's stream extensions (`torch.distributed.checkpoint._extension`, experimental in torch):
transforms such as zstd compression applied to each stored item, recorded per item as
descriptors (`stream.zstd/1`) in `_StorageInfo.transform_descriptors`. Absent before torch 2.7.
"""

from __future__ import annotations

from typing import Any

from ckptlib._torch.dcp_shims import storage_info_fields


def supported() -> bool:
    """Whether this torch records extensions per stored item (`transform_descriptors`)."""
    return "transform_descriptors" in storage_info_fields()


def default_registry() -> Any | None:
    """A fresh `ExtensionRegistry` (knows zstd), or None where this torch has none."""
    try:
        from torch.distributed.checkpoint._extension import ExtensionRegistry
    except ImportError:
        return None
    return ExtensionRegistry()


def is_stream_transform(extension: Any) -> bool:
    """Whether `extension` transforms a stored item's bytes (DCP's StreamTransformExtension)."""
    try:
        from torch.distributed.checkpoint._extension import StreamTransformExtension
    except ImportError:
        return False
    return isinstance(extension, StreamTransformExtension)
