"""Test harness for ckptlib and its users: run a function in N ranks of a fresh process group.

- :func:`launch` (``ckptlib.testing.launcher``) runs ``fn`` on ``world_size`` processes
  forked from a forkserver that imported torch once, and returns the per-rank results.
- ``ckptlib.testing.plugin`` is a pytest plugin (``pytest_plugins = ["ckptlib.testing.plugin"]``)
  with the ``dist_run`` fixture, the ``@pytest.mark.world_size(n)`` marker and ``--backend``.

- Layout builders (imported on first use, they import torch): ``LAYOUTS``, ``apply_layout``,
  ``build_mesh`` (``ckptlib.testing.layouts``) and the layout round trip ``ModelSpec``,
  ``LayoutCase``, ``save_layout``, ``load_layout``, ``full_product``, ``covering_subset``
  (``ckptlib.testing.layout_matrix``): run ``dist_run`` over layout pairs of your own model.

Importing this package does not import torch (torch is imported inside ``launch``).
"""

import importlib

_LAZY = {
    "LAYOUTS": "layouts",
    "apply_layout": "layouts",
    "build_mesh": "layouts",
    "get_layout": "layouts",
    "ModelSpec": "layout_matrix",
    "LayoutCase": "layout_matrix",
    "save_layout": "layout_matrix",
    "load_layout": "layout_matrix",
    "full_product": "layout_matrix",
    "covering_subset": "layout_matrix",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# This package's public names are the launcher's (its __all__), re-exported as they are.
from .launcher import *  # noqa: E402,F401,F403
from .launcher import __all__  # noqa: E402,F401
