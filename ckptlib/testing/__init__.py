"""Test harness for ckptlib and its users: run a function in N ranks of a fresh process group.

- :func:`launch` (``ckptlib.testing.launcher``) runs ``fn`` on ``world_size`` processes
  forked from a forkserver that imported torch once, and returns the per-rank results.
- ``ckptlib.testing.plugin`` is a pytest plugin (``pytest_plugins = ["ckptlib.testing.plugin"]``)
  with the ``dist_run`` fixture, the ``@pytest.mark.world_size(n)`` marker and ``--backend``.

Importing this package does not import torch (torch is imported inside ``launch``).
"""

from .launcher import (
    DEFAULT_PRELOAD,
    DEFAULT_TIMEOUT,
    RankError,
    RankExited,
    RankFailure,
    RankTimeout,
    RemoteError,
    SkipLaunch,
    add_preload,
    forkserver_pid,
    gpu_skip_reason,
    launch,
    start_forkserver,
)

__all__ = [
    "DEFAULT_PRELOAD",
    "DEFAULT_TIMEOUT",
    "RankError",
    "RankExited",
    "RankFailure",
    "RankTimeout",
    "RemoteError",
    "SkipLaunch",
    "add_preload",
    "forkserver_pid",
    "gpu_skip_reason",
    "launch",
    "start_forkserver",
]
