"""ckptlib's DCP writer and reader with the constructors of DCP's FileSystemWriter and
FileSystemReader, so code written for those (PyTorch's own tests) runs on ckptlib unchanged.

Every FileSystemWriter argument is accepted. `overwrite` and `_extensions` mean what they mean
there; the layout arguments (`thread_count`, `single_file_per_rank`, `per_thread_copy_ahead`,
`sync_files`, `serialization_format`, `cache_staged_state_dict`) have no effect: ckptlib writes
one file per rank, always fsynced, in torch.save's format. FileSystemReader's
`_extension_registry` is passed on. With CKPTLIB_DCP_SWAP_LOG set, each construction appends
a line (process id, rank, kind) to that file: proof that the swap reached every rank.
"""

from __future__ import annotations

import json
import os

import ckptlib.dcp


def _log(kind: str) -> None:
    log = os.environ.get("CKPTLIB_DCP_SWAP_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), "kind": kind}) + "\n")


class SwappedWriter(ckptlib.dcp.Writer):
    def __init__(
        self,
        path,
        single_file_per_rank=True,
        sync_files=True,
        thread_count=1,
        per_thread_copy_ahead=0,
        cache_staged_state_dict=False,
        overwrite=True,
        _extensions=None,
        serialization_format=None,
    ):
        _log("writer")
        made = ckptlib.dcp.writer(path, overwrite=overwrite, extensions=_extensions)
        self.__dict__.update(made.__dict__)


class SwappedReader(ckptlib.dcp.Reader):
    def __init__(self, path, _extension_registry=None):
        _log("reader")
        made = ckptlib.dcp.reader(path, extension_registry=_extension_registry)
        self.__dict__.update(made.__dict__)
