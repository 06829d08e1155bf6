"""Checkpointers the harness can prove: ckptlib's own and other tools', behind one protocol.

`ckpt validate --checkpointer module:attr` and `assert_elastic(..., checkpointer=...)` run the
elastic matrix and the crash harness through any object with this shape, so a team can prove
the checkpointer it already uses (plain DCP, torchtitan, Lightning, Accelerate, its own) before
a large run. Modules (adapters are imported on first use; none imports its package at import):

- ``protocol``: :class:`Checkpointer` (the protocol) and :func:`resolve` (a ``module:attr``
  reference, an object or a zero-argument factory, to a checkpointer); :func:`carried`,
  :func:`save_on`, :func:`load_on`: how the harness calls one.
- ``ckptlib_adapter``: :class:`CkptlibCheckpointer` (``ckptlib.CheckpointManager``; the
  default of ``ckpt validate``) and :class:`SingleCheckpoint` (``ckptlib.save``/``load`` of one
  checkpoint).
- ``plain_dcp``: :class:`DCPCheckpointer` (``dcp.save``/``dcp.load`` with
  ``get_state_dict``/``set_state_dict``, a ``step-N`` directory per save; per-rank state not
  carried).
- ``crash_check``: the crash harness for any checkpointer, :func:`crash_check` (a SIGKILL at
  each write boundary of its save, one rank and then every rank, then its own load judged
  bit-exactly) and its :class:`CrashReport`; ``crash_probe`` finds the boundaries by
  interposing on the file and object-store calls in each rank (and names the writes it cannot
  see), ``crash_ranks`` is what each rank runs.
- ``adapter_state``: how the adapters of other tools sort the harness's state (one model, its
  optimizers, stateful objects, per-rank objects, plain values) and read a package's version.
- ``titan_checkpointer``: torchtitan's ``CheckpointManager`` (``ckptlib.testing.checkpointers:torchtitan``).
- ``lightning_checkpointer``: Lightning's sharded checkpoint through Fabric's
  ``ModelParallelStrategy`` (``ckptlib.testing.checkpointers:lightning``).
- ``accelerate_checkpointer``: Accelerate's ``save_state``/``load_state`` with FSDP2
  (``ckptlib.testing.checkpointers:accelerate``).
"""

import importlib
from typing import Any

from ckptlib.testing.checkpointers.protocol import (
    Checkpointer,
    CheckpointerError,
    carried,
    describe,
    load_on,
    resolve,
    save_on,
)

#: Adapters of other tools by the name a reference uses (``ckptlib.testing.checkpointers:NAME``):
#: the module and class, imported on first use so that importing ckptlib.testing never imports
#: the tools.
ADAPTERS = {
    "torchtitan": ("ckptlib.testing.checkpointers.titan_checkpointer", "TorchtitanCheckpointer"),
    "lightning": ("ckptlib.testing.checkpointers.lightning_checkpointer", "LightningCheckpointer"),
    "accelerate": ("ckptlib.testing.checkpointers.accelerate_checkpointer", "AccelerateCheckpointer"),
}

_LAZY = {
    "CkptlibCheckpointer": "ckptlib_adapter",
    "SingleCheckpoint": "ckptlib_adapter",
    "DCPCheckpointer": "plain_dcp",
}


def __getattr__(name: str) -> Any:
    if name in ADAPTERS:
        module, attr = ADAPTERS[name]
        return getattr(importlib.import_module(module), attr)
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ADAPTERS",
    "Checkpointer",
    "CheckpointerError",
    "carried",
    "describe",
    "load_on",
    "resolve",
    "save_on",
    *_LAZY,
]
