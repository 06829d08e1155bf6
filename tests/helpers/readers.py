"""Helpers for tests that drive a StorageReader directly, without DCP's load machinery."""

from __future__ import annotations

import torch


class IntoTensor:
    """A minimal LoadPlanner stand-in: every read item lands in one preallocated tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def resolve_tensor(self, item) -> torch.Tensor:
        return self.tensor

    def commit_tensor(self, item, tensor) -> None:
        pass
