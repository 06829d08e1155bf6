"""ckptlib.testing's public names and module paths after its split into harness/, matrices/ and
fakes/: the new paths and the public names import without a warning; the paths from before the
split are gone in 0.2 (no shims in 0.x: CHANGELOG.md names each replacement).

The checks run in fresh interpreters, where nothing of ckptlib.testing was imported before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The paths from before the split (0.1) and their homes since.
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


@pytest.fixture(scope="module")
def old_path_errors() -> dict:
    """What importing each old path raises, all in one fresh interpreter (nothing of the
    testing package imported before)."""
    return _run(
        f"""
        import importlib
        for old in {sorted(MOVED)!r}:
            try:
                importlib.import_module("ckptlib.testing." + old)
                out[old] = None
            except ModuleNotFoundError as exc:
                out[old] = str(exc)
        """
    )


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_paths_are_gone(old, old_path_errors):
    assert old_path_errors[old] == f"No module named 'ckptlib.testing.{old}'"


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


def test_the_old_layout_name_is_gone():
    from ckptlib.testing.matrices import parallel_layouts

    assert not hasattr(parallel_layouts, "Layout")


def test_unknown_names_still_fail():
    import ckptlib.testing

    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        ckptlib.testing.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        __import__("ckptlib.testing.no_such_module")
