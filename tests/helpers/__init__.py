"""Helpers shared by test modules, one module per subject (tests/conftest.py puts tests/ on
sys.path and has pytest rewrite their asserts): `from helpers.readers import IntoTensor`.
Fixtures are not here: they come from the plugin (ckptlib.testing.plugin) or a conftest.py."""
