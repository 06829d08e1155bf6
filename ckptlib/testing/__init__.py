"""Test harness for ckptlib and its users: run a function in N ranks of a fresh process group.

Four rooms:

- ``harness/``: :func:`launch` (``ckptlib.testing.harness.launcher``) runs ``fn`` on
  ``world_size`` processes forked from a forkserver that imported torch once, and returns the
  per-rank results; its names are re-exported here.
- ``matrices/``: the proof behind the tests and ``ckpt validate``. Layout builders
  (imported on first use, they import torch): ``LAYOUTS``, ``ParallelLayout``, ``apply_layout``,
  ``build_mesh``, ``get_layout`` (``ckptlib.testing.matrices.parallel_layouts``) and the layout
  round trip ``ModelSpec``, ``LayoutCase``, ``save_layout``, ``load_layout``, ``full_product``,
  ``covering_subset`` (``ckptlib.testing.matrices.layout_matrix``): run ``dist_run`` over
  layout pairs of your own model. Your whole training job (optimizers, schedulers, per-rank
  and data-loader state) in one call: ``assert_elastic(spec, world_sizes=..., layouts=...)``
  (``matrices.elastic_proof``) with a ``TrainingSpec`` or a module of factory functions
  (``matrices.training_spec``), as ``ckpt validate --spec`` runs it.
- ``checkpointers/``: any checkpointer behind one protocol (``save(root, step, state)``,
  ``load(root, state)``); ``crash_check(checkpointer, world_size=2)``
  (``checkpointers.crash_check``) kills its save at every write boundary and judges its load,
  returning a ``CrashReport``.
- ``fakes/``: S3, GCS and Azure emulators on 127.0.0.1, a fault-injecting proxy, writers of
  legacy formats.

`plugin` (``ckptlib.testing.plugin``) is the pytest plugin (``pytest_plugins = ["ckptlib.testing.plugin"]``):
the ``dist_run`` fixture, the ``@pytest.mark.world_size(n)`` marker, ``--backend``, and the fakes
as fixtures (``s3_root``, ``gcs_root``, ``azure_root``, ``fault_proxy``, ...).

Importing this package does not import torch (torch is imported inside ``launch``).
"""

import importlib

_LAZY = {
    "LAYOUTS": "matrices.parallel_layouts",
    "ParallelLayout": "matrices.parallel_layouts",
    "apply_layout": "matrices.parallel_layouts",
    "build_mesh": "matrices.parallel_layouts",
    "get_layout": "matrices.parallel_layouts",
    "ModelSpec": "matrices.layout_matrix",
    "LayoutCase": "matrices.layout_matrix",
    "save_layout": "matrices.layout_matrix",
    "load_layout": "matrices.layout_matrix",
    "full_product": "matrices.layout_matrix",
    "covering_subset": "matrices.layout_matrix",
    "TrainingSpec": "matrices.training_spec",
    "SpecError": "matrices.training_spec",
    "SpecFactoryError": "matrices.training_spec",
    "load_spec": "matrices.training_spec",
    "Training": "matrices.spec_matrix",
    "assert_elastic": "matrices.elastic_proof",
    "ElasticAssertionError": "matrices.elastic_proof",
    "crash_check": "checkpointers.crash_check",
    "CrashReport": "checkpointers.crash_check",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# This package's public names are the launcher's (its __all__), re-exported as they are.
from ckptlib.testing.harness.launcher import *  # noqa: E402,F401,F403
from ckptlib.testing.harness.launcher import __all__  # noqa: E402,F401
