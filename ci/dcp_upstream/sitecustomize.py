"""Puts ckptlib's DCP storage in place of DCP's FileSystemWriter/FileSystemReader in *every*
Python process of a test run, when CKPTLIB_DCP_SWAP=1.

PyTorch's DCP tests start each rank with multiprocessing "spawn": the ranks are fresh
interpreters that re-import the test module and never load a conftest, so the swap lives in a
sitecustomize.py on PYTHONPATH, which runs in the pytest process and in every spawned rank. The
adapters (`swap_classes.py`) are bound wherever torch looks the names up: the package
(`dist_cp.FileSystemWriter(...)`, `from torch.distributed.checkpoint import FileSystemWriter`),
`filesystem`, `_storage_utils` (a `dcp.save/load(checkpoint_id=...)` without a storage object)
and `format_utils` (`dcp_to_torch_save`, `torch_save_to_dcp`). Classes that subclassed the
originals at import time (HuggingFaceStorageWriter, FsspecWriter) keep DCP's.
"""

import os

if os.environ.get("CKPTLIB_DCP_SWAP") == "1":
    import torch.distributed.checkpoint as _dcp
    import torch.distributed.checkpoint._storage_utils as _storage_utils
    import torch.distributed.checkpoint.filesystem as _filesystem
    import torch.distributed.checkpoint.format_utils as _format_utils
    from swap_classes import SwappedReader, SwappedWriter

    for _module in (_dcp, _filesystem, _storage_utils, _format_utils):
        _module.FileSystemWriter = SwappedWriter
        _module.FileSystemReader = SwappedReader
