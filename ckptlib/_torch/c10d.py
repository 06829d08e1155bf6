"""The default process group's c10d Store, which torch keeps behind a private accessor: ckptlib
uses it for rank-to-rank signals outside collectives (the check-in, the exit barrier, the roll
call); and gloo groups that connect their ranks lazily (`TORCH_GLOO_LAZY_INIT`)."""

from __future__ import annotations

import os
import threading

_env_lock = threading.Lock()


def default_store():
    """The default process group's c10d Store (the rendezvous store every rank shares)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def new_cpu_group(ranks: list[int], *, local: bool):
    """A gloo group of `ranks` (collective on them; `local`: on them only, else on every rank of
    the world) whose ranks connect to a peer the first time they talk to it, through the store,
    instead of every pair at creation (gloo's full mesh: O(N) store operations and N sockets per
    rank). `TORCH_GLOO_LAZY_INIT` is read when the group is made; a torch without it makes an
    eagerly connected group, which works the same."""
    import torch.distributed as dist

    with _env_lock:
        before = os.environ.get("TORCH_GLOO_LAZY_INIT")
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        try:
            if local:
                return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            return dist.new_group(backend="gloo")
        finally:
            if before is None:
                del os.environ["TORCH_GLOO_LAZY_INIT"]
            else:
                os.environ["TORCH_GLOO_LAZY_INIT"] = before
