"""The StorageReader base of every ckptlib reader (native `dcp_reader.CkptReader` and the
foreign formats' `source.ForeignReader`): DCP's metadata is known before the load starts, so
the planning hooks only pass plans through, compacted for DCP's gather and scatter."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import StorageReader

from ckptlib.format.native import plan_codec


class PlannedReader(StorageReader):
    """A StorageReader whose DCP metadata is known before the load starts (read once on rank 0
    and broadcast): the planning hooks pass plans through; subclasses implement read_data."""

    def __init__(self, metadata: Metadata):
        super().__init__()
        self.metadata = metadata
        self.storage_data: dict[MetadataIndex, Any] = metadata.storage_data
        self.bytes_read = 0

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan_codec.compact_load_plan(plan)  # gathered and scattered by DCP: pickled compactly

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return [plan_codec.compact_load_plan(plan) for plan in plans]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True
