"""Checkpointers the harness can prove: ckptlib's own and other tools', behind one protocol.

`ckpt validate --checkpointer module:attr` and `assert_elastic(..., checkpointer=...)` run the
elastic matrix and the crash harness through any object with this shape, so a team can prove
the checkpointer it already uses (plain DCP, torchtitan, Lightning, Accelerate, its own) before
a large run. Modules (adapters are imported on first use; none imports its package at import):

- ``protocol``: :class:`Checkpointer` (the protocol) and :func:`resolve` (a ``module:attr``
  reference, an object or a zero-argument factory, to a checkpointer).
- ``crash_check``: the crash harness for any checkpointer, :func:`crash_check` (a SIGKILL at
  each write boundary of its save, one rank and then every rank, then its own load judged
  bit-exactly) and its :class:`CrashReport`; ``crash_probe`` finds the boundaries by
  interposing on the file and object-store calls in each rank (and names the writes it cannot
  see), ``crash_ranks`` is what each rank runs.
"""

from ckptlib.testing.checkpointers.protocol import Checkpointer, CheckpointerError, resolve

__all__ = ["Checkpointer", "CheckpointerError", "resolve"]
