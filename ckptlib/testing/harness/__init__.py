"""The distributed test harness: run a function in N ranks of a fresh process group.

``launcher`` (:func:`launch`, with ``forkserver``, ``rank_process``, ``supervision`` and the
errors in ``launch_errors``) and ``dist_plugin``, the pytest side (``dist_run``, the
``world_size`` marker, ``--backend``), enabled through ``ckptlib.testing.plugin``.
The crash harness: `crash_points` crashes an operation at each of its storage writes, in
the scene `crash_scene` sets up, for the operations `crash_operations` registers; `crash_run`
drives it and writes the report (docs/crash-boundaries.md). `ports` picks loopback ports for
servers a test starts in another process (below the ephemeral range, so no connection takes them).
`nodes` runs simulated hosts, one torchrun launcher each (static or elastic c10d rendezvous), and
loses one the way a host is lost (its agent and every worker SIGKILLed), for the tests and
`ckpt bench recovery`. `parent_death` makes what the harness starts (emulators, launchers, xdist
workers) end with the process that started it, however that one ends.

Imports only the standard library (and pytest, for the plugin): torch is imported in ``launch``.
"""
