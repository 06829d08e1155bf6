"""DCP's stream extensions on ckptlib's items: zstd compression (`ZStandard`) and any custom
`StreamTransformExtension`, written and read the way DCP's FileSystemWriter/Reader do.

Writing, each item is streamed through the extensions (`transform_to`, in the order given)
and its storage record lists their descriptors (in reverse: the order that undoes them).
Reading, the descriptors are looked up in an `ExtensionRegistry` (DCP's default knows zstd;
a reader can be given one that knows custom extensions) and applied with `transform_from`.
Checksums cover the stored (transformed) bytes, so a damaged item is found before it is
decoded. A descriptor the registry does not know is `UnsupportedError` (the checkpoint is
not damaged; ckptlib cannot read it), found before anything is read; bytes a known extension
cannot decode are `CheckpointCorruptError`. Decoding is bounded: a tensor item may not expand
past its declared size plus `_TENSOR_SLACK`, an object item past `MAX_DECODED_OBJECT`.
"""

from __future__ import annotations

import io
from typing import Any, Iterable, Sequence

from ckptlib._torch import dcp_extensions
from ckptlib.errors import CheckpointCorruptError, UnsupportedError

# torch.save's archive around a tensor's bytes: a few KiB of records and alignment.
_TENSOR_SLACK = 1 << 20
# The most an object item (a pickle) may expand to when decoded.
MAX_DECODED_OBJECT = 1 << 31
_READ = 1 << 20


def descriptors_of(info: Any) -> tuple[str, ...]:
    """The extension descriptors of a storage record (none for items stored as they are)."""
    return tuple(getattr(info, "transform_descriptors", None) or ())


def _names(descriptors: Iterable[str]) -> list[str]:
    return sorted({d.partition("/")[0] for d in descriptors})


class Transforms:
    """The extensions a writer applies (`extensions`) and the registry a reader decodes with."""

    def __init__(self, extensions: Sequence[Any] | None = None, registry: Any | None = None):
        self.extensions = tuple(extensions or ())
        for ext in self.extensions:
            if not dcp_extensions.is_stream_transform(ext):
                raise UnsupportedError(
                    f"{type(ext).__name__} is not a DCP StreamTransformExtension; ckptlib writes only stream "
                    "transforms (such as torch.distributed.checkpoint._extension.ZStandard)"
                )
        if self.extensions and not dcp_extensions.supported():
            raise UnsupportedError("this torch records no DCP extensions per item (torch 2.7 or newer needed)")
        self.registry = registry
        self._unknown: dict[tuple[str, ...], str | None] = {}

    def _registry(self) -> Any:
        if self.registry is None:
            self.registry = dcp_extensions.default_registry()
        return self.registry

    # -- writing ------------------------------------------------------------------------
    def encoder(self, sink: Any) -> tuple[Any, list[str]]:
        """A stream whose bytes reach `sink` transformed, and the descriptors to record; closing
        it finishes the item without closing `sink`."""
        stream: Any = _Unclosable(sink)
        for ext in self.extensions:
            stream = ext.transform_to(stream)
        return stream, [ext.get_descriptor() for ext in reversed(self.extensions)]

    # -- reading ------------------------------------------------------------------------
    def unknown(self, descriptors: Iterable[str]) -> str | None:
        """Why the registry cannot decode `descriptors` (None when it can)."""
        descriptors = tuple(descriptors)
        if descriptors not in self._unknown:
            registry = self._registry()
            why = None if registry is not None else "this torch has no DCP extensions"
            try:
                if registry is not None:
                    registry.from_descriptor_list(descriptors)
            except Exception as exc:  # noqa: BLE001 - the registry's own words: unknown, or an old version
                why = f"{type(exc).__name__}: {exc}"
            self._unknown[descriptors] = why
        return self._unknown[descriptors]

    def check_readable(self, records: Iterable[Any], uri: str) -> None:
        """UnsupportedError naming every extension of `records` the registry cannot decode."""
        seen: dict[tuple[str, ...], str] = {}
        for info in records:
            descriptors = descriptors_of(info)
            if descriptors and descriptors not in seen:
                seen[descriptors] = getattr(info, "relative_path", "?")
        problems = [(d, f, why) for d, f in seen.items() if (why := self.unknown(d)) is not None]
        if problems:
            descriptors, name, why = problems[0]
            raise UnsupportedError(
                f"{uri}/{name}: items are stored with DCP extension(s) {', '.join(_names(descriptors))} "
                f"({list(descriptors)}), which this reader cannot decode ({why}); the checkpoint is not damaged: "
                "read it with ckptlib.dcp.reader(uri, extension_registry=...) given a registry that knows them",
                path=f"{uri}/{name}",
            )

    def decode(self, data: memoryview, descriptors: Sequence[str], limit: int, where: str) -> memoryview:
        """The item's bytes with `descriptors` undone; at most `limit` bytes."""
        registry = self._registry()
        try:
            extensions = registry.from_descriptor_list(list(descriptors))
        except Exception as exc:  # noqa: BLE001 - found up front by check_readable; here for safety
            raise UnsupportedError(f"{where}: cannot decode DCP extension(s) {list(descriptors)}: {exc}") from exc
        out = bytearray()
        try:
            stream: Any = io.BytesIO(data)
            for ext in extensions:
                if dcp_extensions.is_stream_transform(ext):
                    stream = ext.transform_from(stream)
            while True:
                chunk = stream.read(_READ)
                if not chunk:
                    break
                out += chunk
                if len(out) > limit:
                    raise CheckpointCorruptError(
                        f"{where}: decoding {list(descriptors)} gives more than {limit} bytes, more than the item "
                        "can hold",
                        path=where,
                    )
        except CheckpointCorruptError:
            raise
        except Exception as exc:  # noqa: BLE001 - a known extension that cannot decode these bytes
            raise CheckpointCorruptError(
                f"{where}: cannot decode its {', '.join(_names(descriptors))} stream ({type(exc).__name__}: {exc})",
                path=where,
            ) from exc
        return memoryview(out)


def decoded_limit(nbytes: int | None) -> int:
    """The most a stored item may decode to: a tensor's bytes plus torch.save's archive, or
    MAX_DECODED_OBJECT for an object (`nbytes` None)."""
    return MAX_DECODED_OBJECT if nbytes is None else nbytes + _TENSOR_SLACK


class _Unclosable(io.RawIOBase):
    """The shard stream as an extension's output: writes pass through; closing it (which an
    extension's stream does when it finishes an item) leaves the shard stream open."""

    def __init__(self, sink: Any):
        super().__init__()
        self._sink = sink

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._sink.write(data)

    def flush(self) -> None:
        pass


__all__ = ["MAX_DECODED_OBJECT", "Transforms", "decoded_limit", "descriptors_of"]
