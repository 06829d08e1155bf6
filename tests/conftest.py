"""Tests are grouped by the part of ckptlib they cover: api/ (save, load, async, state),
format/ (formats, checksums, verify, conversion and export), storage/ (backends), elastic/
(the save-at-N/load-at-M matrix, multi-node, GPU), manager/, cli/, harness/. This file puts
tests/ on sys.path, so shared helpers (reader_helpers.py) import from every room."""
