"""One rank of a static two-node job that finishes its work and then aborts at teardown, as
gloo sometimes does after barrier + `destroy_process_group` (GUIDE.md), run by torchrun
(tests/harness/test_torchrun_nodes.py):

    torchrun --nnodes 2 --node-rank K ... teardown_abort.py OUT ABORTING_RANK

Every rank joins a barrier, writes OUT/rank{r}.done and leaves the group; rank ABORTING_RANK
then aborts (SIGABRT), so its launcher fails and skips torchrun's exit barrier."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def main(out: str, aborting: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.done"), "w", encoding="utf-8") as f:
        f.write(str(dist.get_world_size()))
    dist.destroy_process_group()
    if rank == aborting:
        os.abort()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
