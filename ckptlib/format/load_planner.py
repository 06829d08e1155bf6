"""The load planner of every ckptlib load: DCP's default planner with safe unpickling."""

from __future__ import annotations

import io
import pickle
import re

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .. import compat
from ..errors import UnsafeCheckpointError
from . import item_encoder
from .safe_pickle import check_no_allocating_calls


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor objects are unpickled with weights_only."""

    def __init__(self, *, trusted: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.trusted = trusted

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
