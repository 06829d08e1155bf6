"""Helpers shared by the manager tests (test_manager, test_crash, test_tiered and its child process)."""

from __future__ import annotations

import torch


def refuse_lock_deletion(monkeypatch) -> None:
    """Make LocalStorage.delete fail with PermissionError for the manager's lock file only."""
    from ckptlib.manager.lock import LOCK_NAME
    from ckptlib.storage.local import LocalStorage

    real_delete = LocalStorage.delete

    def delete(self, names):
        if list(names) == [LOCK_NAME]:
            raise PermissionError(13, "Permission denied (injected)")
        return real_delete(self, names)

    monkeypatch.setattr(LocalStorage, "delete", delete)


def step_state(step: int) -> dict:
    """A small state whose values are a function of `step` (another step, other values)."""
    gen = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 33, generator=gen), "b": torch.randn(7, generator=gen)}, "step": step}
