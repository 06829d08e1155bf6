"""The pytest plugin of ckptlib: ``pytest_plugins = ["ckptlib.testing.plugin"]`` in a conftest.py.

It registers two plugins:

- ``ckptlib.testing.harness.dist_plugin``: the ``dist_run`` fixture, the
  ``@pytest.mark.world_size(n)`` marker, ``--backend``, ``--dist-timeout``, ``--full-matrix``,
  the ini option ``dist_preload`` and ckptlib's markers;
- ``ckptlib.testing.fakes.fixtures``: S3, GCS and Azure emulators on 127.0.0.1 as fixtures
  (``s3_server``/``s3_root``, ``gcs_server``/``gcs_root``, ``azure_server``/``azure_root``) and
  ``fault_proxy``, to test your own storage code against.

Neither imports torch at collection time.
"""

import importlib

pytest_plugins = ["ckptlib.testing.harness.dist_plugin", "ckptlib.testing.fakes.fixtures"]


def __getattr__(name: str):
    # `from ckptlib.testing.plugin import launch_timeout` keeps working; imported on use, so
    # that pytest imports (and assert-rewrites) the plugins above itself.
    if name == "launch_timeout":
        return importlib.import_module(pytest_plugins[0]).launch_timeout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
