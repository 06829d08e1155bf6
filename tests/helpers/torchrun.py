"""Simulated nodes on this machine for the tests: `ckptlib.testing.harness.nodes` (one torchrun
launcher per node; `kill` is the loss of a node, agent and every worker) with the launchers run
in the repository and ckptlib and tests/ importable, so a worker may be a script under tests/."""

from __future__ import annotations

import os
from pathlib import Path

from ckptlib.testing.harness import nodes as _nodes
from ckptlib.testing.harness.nodes import (  # noqa: F401 - the names the tests import from here
    BARRIER_GRACE,
    ELASTIC_ENV,
    LAUNCH_TIMEOUT,
    kill_tree,
    process_tree,
    worker_with_rank,
)

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def torchrun_env(**extra: str) -> dict[str, str]:
    """The environment of a launcher: gloo on loopback, one OpenMP thread, ckptlib and tests/
    importable, no torchrun variables of an enclosing run."""
    env = _nodes.launcher_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


class Nodes(_nodes.Nodes):
    """Launchers of one job (`ckptlib.testing.harness.nodes.Nodes`), started in the repository
    with `torchrun_env()` unless given an environment."""

    cwd = REPO
    run_prefix = "ckptlib-test-"

    @staticmethod
    def default_env() -> dict[str, str]:
        return torchrun_env()
