"""The ckptlib manifest: written last, it is what makes a checkpoint directory committed.

It records who wrote the checkpoint (format, ckptlib and torch versions, world size, step,
user metadata) and every file with its size and CRC-32, plus the CRC-32 of each item
(offset, length) so a rank that reads only part of a file can still verify what it read.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any

from ..errors import CheckpointCorruptError, StateError

MANIFEST_NAME = "ckptlib.json"
PENDING_NAME = "ckptlib.pending"
METADATA_NAME = ".metadata"
FORMAT_NAME = "ckptlib"
FORMAT_VERSION = 1


@dataclasses.dataclass
class FileRecord:
    size: int
    crc32: int
    # (offset, length, crc32) of every item in the file, in file order.
    items: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": self.crc32, "items": [list(i) for i in self.items]}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "FileRecord":
        try:
            items = [tuple(int(v) for v in item) for item in data.get("items", [])]
            if any(len(i) != 3 for i in items):
                raise ValueError("item records need (offset, length, crc32)")
            return cls(size=int(data["size"]), crc32=int(data["crc32"]), items=items)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed file record ({exc})", path=where) from exc


@dataclasses.dataclass
class Manifest:
    world_size: int
    files: dict[str, FileRecord]
    step: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    torch_version: str = ""
    ckptlib_version: str = ""
    format_version: int = FORMAT_VERSION
    created: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "ckptlib_version": self.ckptlib_version,
            "torch_version": self.torch_version,
            "world_size": self.world_size,
            "step": self.step,
            "created": self.created,
            "metadata": self.metadata,
            "files": {name: rec.to_json() for name, rec in sorted(self.files.items())},
        }
        return json.dumps(doc, indent=1, sort_keys=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: manifest is not valid JSON ({exc})", path=where) from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{where}: not a ckptlib manifest", path=where)
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise CheckpointCorruptError(
                f"{where}: manifest format_version {version!r} is not supported "
                f"(this ckptlib reads 1..{FORMAT_VERSION}; upgrade ckptlib)",
                path=where,
            )
        try:
            files = {str(k): FileRecord.from_json(v, f"{where}:{k}") for k, v in doc["files"].items()}
            step = doc.get("step")
            return cls(
                world_size=int(doc["world_size"]),
                files=files,
                step=None if step is None else int(step),
                metadata=dict(doc.get("metadata") or {}),
                torch_version=str(doc.get("torch_version", "")),
                ckptlib_version=str(doc.get("ckptlib_version", "")),
                format_version=version,
                created=str(doc.get("created", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed manifest ({exc!r})", path=where) from exc


def check_metadata_json(metadata: Any) -> dict[str, Any]:
    """User metadata must survive a JSON round trip unchanged."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise StateError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        encoded = json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise StateError(f"metadata must be JSON-serializable: {exc}") from exc
    if json.loads(encoded) != metadata:
        raise StateError("metadata does not survive a JSON round trip (tuples or non-string keys?)")
    return metadata
