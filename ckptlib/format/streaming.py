"""Streaming conversion: full values out of any DCP reader, tensor by tensor (`SourceValues`),
and a streaming DCP save of them (through CkptWriter); the torch.save and safetensors writers
live with their readers (`torch_save.write_torch_save`, `safetensors.write_safetensors`).

Memory: a source is read one tensor at a time (``SourceValues.tensor``), so peak memory is
a few times the largest tensor, never the checkpoint. Measured (1 GiB of 16 x 64 MiB
tensors, anonymous memory over the process baseline): torch.save file -> DCP +192 MiB,
safetensors -> DCP +256 MiB (the ranged read's bytes too), DCP -> safetensors +192 MiB,
torch.save file -> safetensors +64 MiB. CkptWriter's loop keeps the previous item and its
serialized blob alive while it asks for the next one, hence about 3x for DCP targets.

- DCP: a save planner whose state holds ``meta`` tensors (shapes only) fetches each real
  tensor when the writer asks for it (``resolve_data``) and drops it after writing.
- safetensors: the header is computed from the metadata first, then tensors are appended.
- torch.save needs one object graph of every tensor, so each tensor is first spilled to a
  file and mapped back (``torch.from_file(shared=True)``); torch.save then copies from the
  mappings. Anonymous memory stays about one tensor; the mapped pages are page cache the
  kernel can drop (they count in RSS while resident: DCP -> torch on the same 1 GiB had
  +192 MiB anonymous but 1.1 GiB of file-backed RSS). The spill needs free disk equal to
  the checkpoint next to the output.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageReader

from ckptlib._torch import dcp_shims
from ckptlib.errors import CheckpointError, StateError
from ckptlib.format.read.load_planner import SafeLoadPlanner
from ckptlib.format.write.dcp_writer import CkptWriter


def _dcp_load(template: dict, reader: StorageReader, planner) -> None:
    with dcp_shims.quiet_single_process():
        try:
            dcp_shims.dcp_load_no_dist(template, storage_reader=reader, planner=planner)
        except dcp_shims.checkpoint_exception_cls() as exc:
            for _, inner in dcp_shims.dcp_failures(exc):
                if isinstance(inner, CheckpointError):
                    raise inner from exc
            raise


class SourceValues:
    """The full values of a checkpoint, read through its DCP reader in this process only."""

    def __init__(self, reader: StorageReader, metadata: Metadata, *, trusted: bool = False, uri: str = "checkpoint"):
        self.reader = reader
        self.uri = uri  # what errors name
        self.metadata = metadata
        self.trusted = trusted
        sdm = metadata.state_dict_metadata
        self.tensor_keys = [k for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)]
        self.object_keys = [k for k, v in sdm.items() if isinstance(v, BytesStorageMetadata)]
        planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        self.paths: dict[str, tuple] = {k: tuple(planner_data.get(k) or (k,)) for k in sdm}

    def tensor_meta(self, fqn: str) -> TensorStorageMetadata:
        return self.metadata.state_dict_metadata[fqn]  # type: ignore[return-value]

    def nbytes(self, fqn: str) -> int:
        md = self.tensor_meta(fqn)
        return math.prod(md.size) * torch.empty((), dtype=md.properties.dtype).element_size()

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(k) for k in self.tensor_keys)

    def _planner(self) -> SafeLoadPlanner:
        # No key flattening here: each request is one flat key already, and torch 2.9's
        # flattening builds reference cycles that keep fetched tensors alive until gc.
        return SafeLoadPlanner(
            trusted=self.trusted, allow_partial_load=True, flatten_state_dict=False, flatten_sharded_tensors=False
        )

    def tensor(self, fqn: str) -> torch.Tensor:
        """One full tensor, assembled from however many chunks the source stores it in."""
        md = self.tensor_meta(fqn)
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        if out.numel():
            _dcp_load({fqn: out}, self.reader, self._planner())
        return out

    def objects(self, keys: list[str] | None = None) -> dict[str, Any]:
        """Every non-tensor value (small: hyper-parameters, counters), by flat key (only `keys`
        when given)."""
        wanted = self.object_keys if keys is None else keys
        if not wanted:
            return {}
        template: dict[str, Any] = {k: None for k in wanted}
        _dcp_load(template, self.reader, self._planner())
        return template

    def nested(self, leaves: dict[str, Any]) -> dict[str, Any]:
        """Put flat-keyed values back at their original nesting (from Metadata.planner_data)."""
        root: dict[str, Any] = {}
        for fqn, value in leaves.items():
            dcp_shims.set_element(root, self.paths[fqn], value)
        return root

    def current_keys(self, objects: Callable[[str], bool] | None = None) -> CurrentKeys:
        """This checkpoint keyed by this torch's flattening rules, whichever rules wrote it:
        torch 1.13 stored flat dotted keys and pickled every value it was handed whole (a dict
        of hyper-parameters, even a dict holding tensors), torch 2.0-2.3 pickled whole every
        nested value holding no tensor, 2.4+ keys each leaf. The same state comes out with the
        same keys whatever wrote it (what `ckpt convert` writes and `ckpt diff` compares).
        `objects`: which stored non-tensor entries to read (by stored key; default all)."""
        placeholders = {
            fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
            for fqn, md in ((k, self.tensor_meta(k)) for k in self.tensor_keys)
        }
        chosen = None if objects is None else [k for k in self.object_keys if objects(k)]
        state = self.nested({**placeholders, **self.objects(chosen)})
        try:
            flat, mappings = dcp_shims.flatten_state_dict(state)
        except ValueError as exc:  # "duplicated flatten key a.b": {"a": {"b": ..}} beside a flat "a.b"
            raise StateError(f"{self.uri}: two entries have one key under this torch's rules: {exc}") from None
        by_path = {self.paths[k]: k for k in self.tensor_keys}
        stored: dict[str, str] = {}
        values: dict[str, Any] = {}
        for key, value in flat.items():
            fqn = by_path.get(tuple(mappings[key]))
            if fqn is not None and value is placeholders[fqn]:
                stored[key] = fqn
            else:  # a plain value, or a tensor that was pickled inside a whole object
                values[key] = value
        return CurrentKeys(state, stored, values)


@dataclasses.dataclass
class CurrentKeys:
    """`SourceValues.current_keys`: `state` the nested state (stored tensors as meta tensors),
    `stored` current key -> the stored tensor's own key, `values` current key -> every other
    leaf (hyper-parameters; tensors that were pickled inside a whole object, in memory)."""

    state: dict[str, Any]
    stored: dict[str, str]
    values: dict[str, Any]


# --------------------------------------------------------------------------- DCP


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a state of meta tensors; real data is fetched per item."""

    def __init__(self, fetch: Callable[[str], torch.Tensor]):
        super().__init__()
        self._fetch = fetch

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        tensor = self._fetch(write_item.index.fqn)
        chunk = write_item.tensor_data.chunk
        if tuple(chunk.sizes) != tuple(tensor.shape) or any(chunk.offsets):
            raise AssertionError(f"{write_item.index.fqn}: expected one whole-tensor chunk, got {chunk}")
        return tensor


def save_dcp_streaming(
    writer: CkptWriter, source: SourceValues, *, on_tensor: Callable[[str, int], None] | None = None
) -> Metadata:
    """Write `source` as a DCP checkpoint (one rank) through `writer` (its SaveTransaction
    prepares the target and commits the manifest), one tensor in memory at a time.

    Keys are re-flattened with this torch's rules from the source's nesting, so an old
    (pre-2.4) checkpoint comes out with current keys. Returns what `dcp.save` returns.
    """
    keys = source.current_keys()

    def fetch(new_fqn: str) -> torch.Tensor:
        if new_fqn not in keys.stored:  # a tensor torch 1.13 pickled inside a whole object
            return keys.values[new_fqn]
        fqn = keys.stored[new_fqn]
        tensor = source.tensor(fqn)
        if on_tensor is not None:
            on_tensor(fqn, tensor.numel() * tensor.element_size())
        return tensor

    with dcp_shims.quiet_single_process():
        return dcp_shims.dcp_save_no_dist(keys.state, storage_writer=writer, planner=_StreamingSavePlanner(fetch))


def iter_tensors(source: SourceValues) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full tensor of `source`, one at a time."""
    for fqn in source.tensor_keys:
        yield fqn, source.tensor(fqn)


__all__ = ["CurrentKeys", "SourceValues", "iter_tensors", "save_dcp_streaming"]
