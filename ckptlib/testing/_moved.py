"""The module paths ``ckptlib.testing`` had before it was split into ``harness/``, ``matrices/``
and ``fakes/``: each still imports, as the very module object of its new home (so monkeypatching
and ``isinstance`` see one module), with a DeprecationWarning. They go in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

PACKAGE = "ckptlib.testing"

#: old module name under ckptlib.testing -> its new name under ckptlib.testing
MOVED = {
    "launcher": "harness.launcher",
    "forkserver": "harness.forkserver",
    "rank_process": "harness.rank_process",
    "supervision": "harness.supervision",
    "launch_errors": "harness.launch_errors",
    "matrix": "matrices.matrix",
    "layouts": "matrices.parallel_layouts",
    "layout_matrix": "matrices.layout_matrix",
    "models": "matrices.models",
    "training_states": "matrices.training_states",
    "validate": "matrices.validate",
    "s3_server": "fakes.s3_server",
    "emulators": "fakes.emulators",
    "faultproxy": "fakes.faultproxy",
    "legacy_writers": "fakes.legacy_writers",
}


def new_name(old: str) -> str | None:
    """The new full name of the moved module `old` (a full name), None if it did not move."""
    package, _, short = old.rpartition(".")
    return f"{PACKAGE}.{MOVED[short]}" if package == PACKAGE and short in MOVED else None


def warn_moved(old: str, new: str, stacklevel: int = 2) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path is deprecated and will be removed in the next release",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names (and only those) on ``sys.meta_path``; loads each as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        return importlib.util.spec_from_loader(fullname, self, origin=new) if new else None

    def create_module(self, spec):
        new = spec.origin
        warn_moved(spec.name, new)  # (importlib's own frames are skipped: the importer is blamed)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # importlib gave the module the old name's spec; it keeps its own.
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per process."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
