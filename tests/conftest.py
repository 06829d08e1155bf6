"""Tests are grouped by the part of ckptlib they cover: api/ (save, load, async, state),
format/ (formats, checksums, verify, conversion and export), storage/ (backends), elastic/
(the save-at-N/load-at-M matrix, multi-node, GPU), manager/, cli/, harness/.

Fixtures come from the plugin (dist_run, the emulators' s3_root/gcs_root/azure_root...:
ckptlib.testing.plugin, registered by the repository's conftest.py) or from conftest.py
files; helpers shared by test modules live in helpers/ (`from helpers.golden import diff`),
importable because this file puts tests/ on sys.path. No test module imports another."""

import pytest

# Asserts in the helpers fail with pytest's explanations, also in ranks (the launcher hands
# every rewritten module to them).
pytest.register_assert_rewrite("helpers")
