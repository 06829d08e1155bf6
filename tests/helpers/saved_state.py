"""What the async-save tests compare: a loaded state against the saved one (bit-exact tensors of
the same dtype, equal plain values) and the bytes of a checkpoint's shard files."""

from __future__ import annotations

import os

import torch


def assert_equal(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def shard_bytes(path) -> dict[str, bytes]:
    """Every `*.distcp` file of the checkpoint at `path`, by name, with its bytes."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".distcp"):
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
    return out
