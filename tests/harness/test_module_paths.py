"""ckptlib.testing's public names and module paths after its split into harness/, matrices/ and
fakes/: the old paths keep importing for one release, as the very module of their new home, with a
DeprecationWarning naming it; the new paths and the public names import without one.

Each check runs in a fresh interpreter: an old path warns on its first import in a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Written out here (not read from ckptlib.testing._moved) so that a path dropped there fails.
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
PUBLIC = (
    "launch",
    "RankError",
    "RankExited",
    "RankTimeout",
    "SkipLaunch",
    "gpu_skip_reason",
    "ModelSpec",
    "LayoutCase",
    "save_layout",
    "load_layout",
    "full_product",
    "covering_subset",
    "apply_layout",
    "build_mesh",
    "get_layout",
    "LAYOUTS",
    "ParallelLayout",
)


def _run(body: str) -> dict:
    """Run `body` (which sets `out`) in a fresh interpreter; returns `out`."""
    script = "import json, warnings\nwarnings.simplefilter('always')\nout = {}\n" + textwrap.dedent(body)
    script += "\nprint(json.dumps(out))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("form", ["import", "from-import"])
def test_old_paths_are_the_new_modules_with_a_deprecation_warning(form):
    statement = (
        "importlib.import_module(f'ckptlib.testing.{old}')"
        if form == "import"
        else "getattr(__import__('ckptlib.testing', fromlist=[old]), old)"
    )
    out = _run(
        f"""
        import importlib, sys
        import ckptlib.testing
        moved = {MOVED!r}
        for old, new in moved.items():
            with warnings.catch_warnings(record=True) as caught:
                module = {statement}
                again = importlib.import_module(f"ckptlib.testing.{{old}}")
            target = sys.modules[f"ckptlib.testing.{{new}}"]
            out[old] = {{
                "same": module is target and again is target,
                "name": module.__name__,
                "spec": module.__spec__.name,
                "warnings": [(w.category.__name__, str(w.message)) for w in caught],
            }}
        """
    )
    for old, new in MOVED.items():
        got = out[old]
        assert got["same"] and got["name"] == got["spec"] == f"ckptlib.testing.{new}", (old, got)
        moved = [(c, m) for c, m in got["warnings"] if m.startswith(f"ckptlib.testing.{old} moved")]
        assert moved == [
            (
                "DeprecationWarning",
                f"ckptlib.testing.{old} moved to ckptlib.testing.{new}; the old path is deprecated and will be "
                "removed in the next release",
            )
        ], (old, got["warnings"])


def test_new_paths_plugin_and_public_names_import_without_a_warning():
    modules = ["ckptlib.testing.plugin", "ckptlib.testing.fakes.fixtures", "ckptlib.testing.harness.dist_plugin"]
    modules += [f"ckptlib.testing.{new}" for new in MOVED.values()]
    out = _run(
        f"""
        import importlib
        warnings.simplefilter("error", DeprecationWarning)
        for name in {modules!r}:
            importlib.import_module(name)
        import ckptlib.testing as ct
        out["missing"] = [name for name in {PUBLIC!r} if not hasattr(ct, name)]
        from ckptlib.testing.plugin import launch_timeout
        out["launch_timeout"] = launch_timeout.__module__
        out["layouts"] = sorted(ct.LAYOUTS)
        out["parallel_layout"] = type(ct.get_layout("fsdp2")).__name__
        """
    )
    assert out["missing"] == []
    assert out["launch_timeout"] == "ckptlib.testing.harness.dist_plugin"
    assert out["layouts"] == sorted(["plain", "ddp", "fsdp2", "hsdp", "tp", "fsdp2+tp", "fsdp1", "fsdp1-flat"])
    assert out["parallel_layout"] == "ParallelLayout"


def test_layout_is_now_parallel_layout():
    out = _run(
        """
        from ckptlib.testing.matrices import parallel_layouts
        with warnings.catch_warnings(record=True) as caught:
            out["same"] = parallel_layouts.Layout is parallel_layouts.ParallelLayout
        out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
        """
    )
    assert out["same"]
    assert out["warnings"] == [
        [
            "DeprecationWarning",
            "ckptlib.testing.matrices.parallel_layouts.Layout is now ParallelLayout; the old name is deprecated and "
            "will be removed in the next release",
        ]
    ]


def test_unknown_names_still_fail():
    import ckptlib.testing

    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        ckptlib.testing.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        __import__("ckptlib.testing.no_such_module")
