"""The default process group's c10d Store, which torch keeps behind a private accessor: ckptlib
uses it for rank-to-rank signals outside collectives (the exit barrier, naming absent ranks)."""

from __future__ import annotations


def default_store():
    """The default process group's c10d Store (the rendezvous store every rank shares)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
