"""Checkpointers the harness can prove: ckptlib's own and other tools', behind one protocol.

`ckpt validate --checkpointer module:attr` and `assert_elastic(..., checkpointer=...)` run the
elastic matrix and the crash harness through any object with this shape, so a team can prove
the checkpointer it already uses (plain DCP, torchtitan, Lightning, Accelerate, its own) before
a large run. Modules (adapters are imported on first use; none imports its package at import):

- ``protocol``: :class:`Checkpointer` (the protocol) and :func:`resolve` (a ``module:attr``
  reference, an object or a zero-argument factory, to a checkpointer).
"""

from ckptlib.testing.checkpointers.protocol import Checkpointer, CheckpointerError, resolve

__all__ = ["Checkpointer", "CheckpointerError", "resolve"]
