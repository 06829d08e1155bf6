"""Benchmarks (not installed with ckptlib): `python benchmarks/bench.py --help`."""
