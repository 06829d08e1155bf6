"""Helpers shared by the manager tests."""

from __future__ import annotations


def refuse_lock_deletion(monkeypatch) -> None:
    """Make LocalStorage.delete fail with PermissionError for the manager's lock file only."""
    from ckptlib.lock import LOCK_NAME
    from ckptlib.storage.local import LocalStorage

    real_delete = LocalStorage.delete

    def delete(self, names):
        if list(names) == [LOCK_NAME]:
            raise PermissionError(13, "Permission denied (injected)")
        return real_delete(self, names)

    monkeypatch.setattr(LocalStorage, "delete", delete)
