"""The ckptlib manifest: written last, it is what makes a checkpoint directory committed.

It records who wrote the checkpoint (format, ckptlib and torch versions, world size, step,
user metadata) and every file with its size and CRC-32, plus the CRC-32 of each item
(offset, length) so a rank that reads only some items can still verify what it read, and
(optionally, `blocks`) the CRC-32 of each fixed-size block of the file, so a rank that
reads only part of an item (a resharded load) verifies the blocks it touches instead of
reading the whole item. Readers that predate `blocks` ignore it.
The manifest carries a CRC-32 of its own canonical JSON (`checksum`), so a damaged manifest
is detected too; manifests without one (written before it existed) are still accepted.
File names must stay inside the checkpoint directory: a name that is absolute or holds
`..` is refused (UnsafeCheckpointError) before anything is read.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import zlib
from typing import Any

from ckptlib.errors import CheckpointCorruptError, StateError, UnsafeCheckpointError

MANIFEST_NAME = "ckptlib.json"
PENDING_NAME = "ckptlib.pending"
METADATA_NAME = ".metadata"
FORMAT_NAME = "ckptlib"
FORMAT_VERSION = 1
# Written into `.metadata` (StorageMeta.modules) so a ckptlib checkpoint that lost its
# manifest is never mistaken for plain DCP; plain `dcp.load` ignores the field.
METADATA_MARKER = "ckptlib"


def check_name(name: Any, where: str, what: str = "file name") -> str:
    """`name` if it is a relative path that stays inside the checkpoint, else UnsafeCheckpointError.

    Checkpoint files (manifest entries, `.metadata` storage records) are read relative to the
    checkpoint directory; a crafted absolute name or one with `..` would read elsewhere.
    """
    if not isinstance(name, str) or not name:
        raise UnsafeCheckpointError(f"{where}: invalid {what} {name!r}", path=where)
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise UnsafeCheckpointError(
            f"{where}: {what} {name!r} escapes the checkpoint directory (absolute or '..'); refusing to read it",
            path=where,
        )
    return name


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _readable(doc: dict[str, Any]) -> str:
    """JSON with one line per top-level field and per file record: readable, and written by
    json's C encoder (an indented dump goes through its Python encoder, ~1 s at 10,000 items)."""
    lines = []
    for key, value in doc.items():
        if key == "files" and value:
            records = ",\n".join(f"  {json.dumps(name)}: {json.dumps(rec)}" for name, rec in value.items())
            lines.append(f" {json.dumps(key)}: {{\n{records}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}"


def block_count(size: int, block_size: int) -> int:
    return -(-size // block_size) if block_size > 0 else 0


@dataclasses.dataclass
class FileRecord:
    size: int
    crc32: int
    # (offset, length, crc32) of every item in the file, in file order.
    items: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    # CRC-32 of bytes [i * block_size, (i + 1) * block_size) of the file for every i (the last
    # block may be short); block_size 0: none recorded.
    block_size: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"size": self.size, "crc32": self.crc32, "items": [list(i) for i in self.items]}
        if self.block_size:
            doc["blocks"] = {"size": self.block_size, "crc32": list(self.blocks)}
        return doc

    @classmethod
    def from_json(cls, data: Any, where: str) -> "FileRecord":
        try:
            items = [tuple(int(v) for v in item) for item in data.get("items", [])]
            if any(len(i) != 3 for i in items):
                raise ValueError("item records need (offset, length, crc32)")
            blocks = data.get("blocks")
            block_size = 0 if blocks is None else int(blocks["size"])
            block_crcs = [] if blocks is None else [int(v) for v in blocks["crc32"]]
            record = cls(
                size=int(data["size"]),
                crc32=int(data["crc32"]),
                items=items,  # type: ignore[arg-type]
                block_size=block_size,
                blocks=block_crcs,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed file record ({exc})", path=where) from exc
        problem = record.problem()
        if problem:
            raise CheckpointCorruptError(f"{where}: malformed file record ({problem})", path=where)
        return record

    def problem(self) -> str | None:
        """Why this record cannot describe a real file (negative sizes, items outside the file or
        overlapping each other, a block list that does not cover the file), or None."""
        if self.size < 0 or not 0 <= self.crc32 < 1 << 32:
            return f"size {self.size}, crc32 {self.crc32}"
        end = 0
        for off, length, crc in self.items:
            if off < 0 or length < 0 or not 0 <= crc < 1 << 32:
                return f"item ({off}, {length}, {crc}) has a negative offset or length, or a bad crc32"
            if off + length > self.size:
                return f"item at offset {off} (length {length}) ends past the file size {self.size}"
            if off < end:
                return f"item at offset {off} overlaps the previous item or is out of order"
            end = off + length
        if self.block_size < 0 or (self.blocks and not self.block_size):
            return f"block size {self.block_size} with {len(self.blocks)} block checksums"
        if self.block_size and len(self.blocks) != block_count(self.size, self.block_size):
            return (
                f"{len(self.blocks)} block checksums for {self.size} bytes in blocks of {self.block_size} "
                f"(needs {block_count(self.size, self.block_size)})"
            )
        if any(not 0 <= crc < 1 << 32 for crc in self.blocks):
            return "a block crc32 out of range"
        return None


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """Where a save stands in its run's commit order (written by the cluster tier).

    `seq`: 1 + the largest seq the saving job had seen (its own saves, every node's local
    steps, the remote `latest`), so the newest commit wins even when it has a lower step
    number (a rollback). `parent`: the step the job last saved or resumed from (None after a
    fresh start). `run`: an id of the job that saved it. `nodes`: the global ranks of each
    node (distinct local root) of the saving job, so a copy of a rank's file found on another
    node is known to be a replica."""

    seq: int
    parent: int | None = None
    run: str = ""
    nodes: tuple[tuple[int, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "parent": self.parent, "run": self.run, "nodes": [list(n) for n in self.nodes]}

    @classmethod
    def from_json(cls, data: Any) -> "CommitRecord":
        parent = data.get("parent")
        return cls(
            seq=_strict_int(data["seq"], "commit seq"),
            parent=None if parent is None else _strict_int(parent, "commit parent"),
            run=str(data.get("run", "")),
            nodes=tuple(tuple(_strict_int(r, "commit rank") for r in node) for node in data.get("nodes", ())),
        )


@dataclasses.dataclass
class Manifest:
    world_size: int
    files: dict[str, FileRecord]
    step: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    torch_version: str = ""
    # Training metrics given to the save (`metrics=`): name -> number, or None for NaN/inf.
    metrics: dict[str, float | None] = dataclasses.field(default_factory=dict)
    ckptlib_version: str = ""
    format_version: int = FORMAT_VERSION
    created: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )
    commit: CommitRecord | None = None  # the commit order, when a cluster tier saved it

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.files.values())

    def commit_order(self, named_by_latest: bool = False) -> tuple:
        """Sorts commits oldest first: manifests without a commit record before any with one
        (the one its root's `latest` names, `named_by_latest`, newest of them; then by creation
        time and step: a one-second stamp from the saving host's clock), the others by their
        record's seq."""
        if self.commit is None:
            return (0, int(named_by_latest), self.created, self.step or 0)
        return (1, self.commit.seq, self.created, self.step or 0)

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
        if self.metrics:
            doc["metrics"] = self.metrics
        if self.commit is not None:
            doc["commit"] = self.commit.to_json()
        doc["checksum"] = zlib.crc32(_canonical(doc))
        return _readable(doc).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: manifest is not valid JSON ({exc})", path=where) from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{where}: not a ckptlib manifest", path=where)
        checksum = doc.pop("checksum", None)
        if checksum is not None and checksum != zlib.crc32(_canonical(doc)):
            raise CheckpointCorruptError(
                f"{where}: manifest checksum mismatch (the manifest itself is damaged or was edited)", path=where
            )
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise CheckpointCorruptError(
                f"{where}: manifest format_version {version!r} is not supported "
                f"(this ckptlib reads 1..{FORMAT_VERSION}; upgrade ckptlib)",
                path=where,
            )
        if isinstance(doc.get("files"), dict):
            for name in doc["files"]:
                check_name(name, where, "manifest file name")
        try:
            files = {str(k): FileRecord.from_json(v, f"{where}:{k}") for k, v in doc["files"].items()}
            step = doc.get("step")
            world_size = _strict_int(doc["world_size"], "world_size")
            if step is not None:
                step = _strict_int(step, "step")
            if world_size < 1 or (step is not None and not 0 <= step <= INT64_MAX):
                raise ValueError(f"world_size {world_size}, step {step}")
            if world_size > len(files):
                # Every rank writes a shard file (an empty one when it has nothing to save):
                # a larger world size is a lie that would make readers size things by it.
                raise ValueError(f"world_size {world_size} with only {len(files)} files listed")
            commit = doc.get("commit")
            return cls(
                commit=None if commit is None else CommitRecord.from_json(commit),
                world_size=world_size,
                files=files,
                step=None if step is None else int(step),
                metadata=dict(doc.get("metadata") or {}),
                metrics=dict(doc.get("metrics") or {}),
                torch_version=str(doc.get("torch_version", "")),
                ckptlib_version=str(doc.get("ckptlib_version", "")),
                format_version=version,
                created=str(doc.get("created", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointCorruptError(f"{where}: malformed manifest ({exc!r})", path=where) from exc


def check_metrics(metrics: Any) -> dict[str, float | None]:
    """Metrics must map non-empty names to real numbers; NaN and infinities are stored as None
    (JSON has no such numbers, and no retention policy ranks them)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise StateError(f"metrics must be a dict of names to numbers, got {type(metrics).__name__}")
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise StateError(f"metric name {name!r} must be a non-empty string")
        if hasattr(value, "item") and callable(value.item) and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()  # a one-element tensor or numpy scalar
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StateError(f"metric {name!r} must be a number, got {type(value).__name__} {value!r}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int beyond any float: no retention policy could rank it
            raise StateError(
                f"metric {name!r} is an int of {value.bit_length()} bits, too large for a float (at most about 1.8e308)"
            ) from None
        out[name] = value if finite else None
    return out


INT64_MAX = (1 << 63) - 1


def _strict_int(value: Any, what: str) -> int:
    """An int from JSON: a float (1.5, or 2.0) or a bool is no count or step."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} {value!r} is not an integer")
    return value


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
