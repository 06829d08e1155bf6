# The distributed test harness (dist_run fixture, world_size marker, --backend option).
pytest_plugins = ["ckptlib.testing.plugin"]
