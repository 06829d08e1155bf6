"""Copies of a checkpoint as a cluster keeps them: node-local directories holding only their own
ranks' shard files (plus the manifest and `.metadata`), and damage to one copy."""

from __future__ import annotations

import os
import shutil
from typing import Sequence

from ckptlib.format.native.file_names import shard_rank

COMMON = ("ckptlib.json", ".metadata")


def node_dirs(src: str, base: str, nodes: Sequence[Sequence[int]], *, common: bool = True) -> list[str]:
    """Split the checkpoint at `src` into one directory per node under `base`: node k gets the
    shard files written by the ranks in `nodes[k]` (and, with `common`, the manifest and
    `.metadata`). Returns the directories."""
    out = []
    for index, ranks in enumerate(nodes):
        dst = os.path.join(base, f"node{index}")
        os.makedirs(dst, exist_ok=True)
        for name in os.listdir(src):
            if (common and name in COMMON) or shard_rank(name) in ranks:
                shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
        out.append(dst)
    return out


def shard_files(path: str, ranks: Sequence[int] | None = None) -> list[str]:
    """The shard files in `path` (of `ranks` only, when given)."""
    names = sorted(n for n in os.listdir(path) if shard_rank(n) is not None)
    return [n for n in names if ranks is None or shard_rank(n) in ranks]


def damage(path: str) -> None:
    """Flip one byte in the middle of the file at `path` (a checksum mismatch for whatever item lies there)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
