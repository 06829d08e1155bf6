"""One rank of a multi-node read-once load, run by torchrun (tests/elastic/test_read_once_nodes.py):

    torchrun --nnodes 2 --node-rank K ... read_once_node.py BASE OUT [--no-read-once]

Rank r of node K (torchrun's GROUP_RANK) loads the replicated state `state(0.0)` from its
node's directory BASE/nodeK only (a node-local root holding that node's shard files, the
manifest and `.metadata`), records every path below BASE it stats, opens or lists, and writes
what it loaded and read to OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def state(fill: float) -> dict:
    return {
        "model": {f"w{i}": torch.full((48 + i, 512), fill + i) for i in range(8)},
        "meta": {"names": ["a", "b"], "lr": 0.25 + fill},
        "step": 5,
    }


def _record_paths(base: str) -> list[str]:
    """Paths below `base` this process touches (os.stat/open/scandir/listdir), from now on."""
    touched: list[str] = []
    for name in ("stat", "open", "scandir", "listdir"):
        original = getattr(os, name)

        def wrapper(path=".", *args, _original=original, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(base):
                touched.append(os.path.abspath(os.fspath(path)))
            return _original(path, *args, **kwargs)

        setattr(os, name, wrapper)
    return touched


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    import ckptlib
    from ckptlib.format.read.copies import Copy
    from ckptlib.storage import LocalStorage

    base, out = os.path.abspath(argv[0]), argv[1]
    read_once = "--no-read-once" not in argv
    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    local = os.path.join(base, f"node{node}")
    files = set(os.listdir(local))
    touched = _record_paths(base)
    loaded = state(-1.0)
    result = ckptlib.load(local, loaded, copies=[Copy("local", LocalStorage(local), files=files)], read_once=read_once)
    expected = state(0.0)
    exact = all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items())
    report = {
        "rank": rank,
        "node": node,
        "exact": exact and loaded["meta"] == expected["meta"] and loaded["step"] == 5,
        "read": result.storage_bytes_read,
        "by_rank": result.storage_bytes_read_by_rank,
        "by_source": result.bytes_by_source,
        "received": result.bytes_received,
        "needed": result.bytes_needed,
        "outside_own_node": sorted({p for p in touched if not p.startswith(local + os.sep) and p != local}),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
