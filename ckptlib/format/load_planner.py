"""The load planner of every ckptlib load: DCP's default planner with safe unpickling."""

from __future__ import annotations

import io
import pickle
import re

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan

from .. import compat
from ..errors import UnsafeCheckpointError
from . import item_encoder
from .safe_pickle import check_no_allocating_calls


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor objects are unpickled with weights_only."""

    def __init__(self, *, trusted: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.trusted = trusted

    def create_local_plan(self):
        # DCP takes a rank that asks for fewer keys than the checkpoint holds for a reader of
        # a pre-2.4 checkpoint and re-flattens its state the 2.3 way, which then misses
        # keys such as "optim.param_groups". A rank whose shard of a parameter is empty asks
        # for fewer keys legitimately (FSDP1 gives it no optimizer state for that parameter):
        # when every key this rank asks for is in the checkpoint, plan with those keys.
        if self.flatten_state_dict and self.metadata is not None:
            if set(self.state_dict) <= set(self.metadata.state_dict_metadata):
                return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        if self.trusted:
            return super().load_bytes(read_item, value)
        data = value.getvalue()
        header = item_encoder.tensor_pickle(lambda pos, n: data[pos : pos + n], len(data), limit=len(data))
        if header is not None:
            check_no_allocating_calls(header, f"object {read_item.dest_index.fqn!r}")
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message is many lines of advice; keep the global it refused.
            text = str(exc)
            found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
            if found:
                detail = f"it names the global {found.group(1)}"
            else:
                found = re.search(r"WeightsUnpickler error: ([^\n]+)", text)
                detail = (found.group(1) if found else (text.strip().splitlines() or [""])[0])[:200]
            raise UnsafeCheckpointError(
                f"object {read_item.dest_index.fqn!r} needs arbitrary unpickling ({detail}), which weights_only "
                "loading refuses; pass trusted=True only if you trust this checkpoint's author"
            ) from exc
        if self.flatten_state_dict:
            compat.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
