"""The distributed test harness: run a function in N ranks of a fresh process group.

``launcher`` (:func:`launch`, with ``forkserver``, ``rank_process``, ``supervision`` and the
errors in ``launch_errors``) and ``dist_plugin``, the pytest side (``dist_run``, the
``world_size`` marker, ``--backend``), enabled through ``ckptlib.testing.plugin``.
Imports only the standard library (and pytest, for the plugin): torch is imported in ``launch``.
"""
