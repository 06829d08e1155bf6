"""ckptlib itself as a checkpointer: what ``ckpt validate`` and ``assert_elastic`` prove by default.

:class:`CkptlibCheckpointer` is a training loop's :class:`ckptlib.CheckpointManager` on ``root``
(a step directory per save, ``latest``; any URI ckptlib writes): ``save`` is
``manager.save(step, state)``, ``load`` is ``manager.load(state)``. It carries every entry of the
state, per-rank state (``ckptlib.RankLocal``) by its resize policy.

:class:`SingleCheckpoint` is ``ckptlib.save(root, state, step=...)`` / ``ckptlib.load(root,
state)``: one checkpoint at ``root`` itself, no manager (the matrices' round trip of one
checkpoint, e.g. in the test suite's ``matrix.save_side``).
"""

from __future__ import annotations

from typing import Any


class CkptlibCheckpointer:
    """``ckptlib.CheckpointManager(root, **options)``: one manager per call, closed after it."""

    name = "ckptlib"

    def __init__(self, **options: Any):
        self.options = options  # CheckpointManager's keywords (keep_last, cluster, ...)

    def _manager(self, root: str, process_group: Any):
        import ckptlib

        return ckptlib.CheckpointManager(root, process_group=process_group, **self.options)

    def save(self, root: str, step: int, state: dict, *, process_group: Any = None) -> None:
        manager = self._manager(root, process_group)
        try:
            manager.save(step, state)
        finally:
            manager.close()

    def load(self, root: str, state: dict, *, process_group: Any = None) -> int | None:
        manager = self._manager(root, process_group)
        try:
            return manager.load(state)
        finally:
            manager.close()


class SingleCheckpoint:
    """``ckptlib.save`` / ``ckptlib.load`` of one checkpoint at ``root`` (its ``metadata`` is
    stored with each save)."""

    name = "ckptlib.save"

    def __init__(self, metadata: dict[str, Any] | None = None):
        self.metadata = metadata

    def save(self, root: str, step: int, state: dict, *, process_group: Any = None) -> None:
        import ckptlib

        ckptlib.save(root, state, step=step, metadata=self.metadata, process_group=process_group)

    def load(self, root: str, state: dict, *, process_group: Any = None) -> int | None:
        import ckptlib

        return ckptlib.load(root, state, process_group=process_group).step


__all__ = ["CkptlibCheckpointer", "SingleCheckpoint"]
