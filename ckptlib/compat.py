"""Deprecated: torch's private names and feature probes moved to the `ckptlib._torch` package,
and the streaming torch.save archive writer to `ckptlib.format.foreign.torch_archive`.

This module re-exports the names it used to define for one release and warns on import; it
will be removed in the next one. Every probe answers as before (`describe()` is
`ckptlib._torch.report.describe`). `torch_version` and `check_torch_supported` are gone
(nothing used them; `torch.__version__` and `describe()["supported"]` say the same).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from ckptlib._torch.c10d import default_store
from ckptlib._torch.dcp_shims import (
    checkpoint_exception_cls,
    create_write_items,
    current_pickle_module,
    dcp_accepts,
    dcp_failures,
    dcp_load_no_dist,
    dcp_parameters,
    dcp_save_no_dist,
    dedup_save_plans,
    flatten_state_dict,
    flatten_state_dict_pre_2_4,
    quiet_single_process,
    set_element,
    storage_info_cls,
    storage_info_fields,
)
from ckptlib._torch.parallel import (
    checkpoint_wrapper_fn,
    distribute_locally,
    dtensor_api,
    fsdp1_cpu_reason,
    fsdp2_cpu_reason,
    fsdp2_reason,
    fully_shard_fn,
    init_device_mesh_fn,
    layout_gap_reason,
    require_fsdp2_cpu,
)
from ckptlib._torch.probes import (
    MIN_TORCH,
    cuda_available,
    dtensor_cls,
    dtensor_module_name,
    gloo_available,
    nccl_available,
)
from ckptlib._torch.report import describe
from ckptlib._torch.serialization import (
    has_safe_globals,
    load_weights_only_default,
    meta_load_records_offsets,
    meta_storage_offset,
    torch_save_without_zip_crc,
)
from ckptlib.format.foreign.torch_archive import TorchArchiveWriter, streaming_torch_save_reason


def _importer_stacklevel() -> int:
    """warnings' stacklevel of the code that imports this module. warnings skips importlib's
    bootstrap frames itself; this also steps over `importlib.import_module` and the package's
    lazy `ckptlib.compat` attribute, so the warning names the user's line and Python's default
    filters (a DeprecationWarning shows where `__main__` triggers it) apply as usual."""
    machinery = (importlib.__file__, os.path.join(os.path.dirname(__file__), "__init__.py"))
    frame, level = sys._getframe(2), 2
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in machinery:
            level += 1
        elif not ("importlib" in filename and "_bootstrap" in filename):
            break
        frame = frame.f_back
    return level


warnings.warn(
    "ckptlib.compat is deprecated and will be removed in the next release: its probes live in "
    "ckptlib._torch (describe() in ckptlib._torch.report) and TorchArchiveWriter in ckptlib.format.foreign.torch_archive",
    DeprecationWarning,
    stacklevel=_importer_stacklevel(),
)

__all__ = [
    "MIN_TORCH",
    "TorchArchiveWriter",
    "checkpoint_exception_cls",
    "checkpoint_wrapper_fn",
    "create_write_items",
    "cuda_available",
    "current_pickle_module",
    "dcp_accepts",
    "dcp_failures",
    "dcp_load_no_dist",
    "dcp_parameters",
    "dcp_save_no_dist",
    "dedup_save_plans",
    "default_store",
    "describe",
    "distribute_locally",
    "dtensor_api",
    "dtensor_cls",
    "dtensor_module_name",
    "flatten_state_dict",
    "flatten_state_dict_pre_2_4",
    "fsdp1_cpu_reason",
    "fsdp2_cpu_reason",
    "fsdp2_reason",
    "fully_shard_fn",
    "gloo_available",
    "has_safe_globals",
    "init_device_mesh_fn",
    "layout_gap_reason",
    "load_weights_only_default",
    "meta_load_records_offsets",
    "meta_storage_offset",
    "nccl_available",
    "quiet_single_process",
    "require_fsdp2_cpu",
    "set_element",
    "storage_info_cls",
    "storage_info_fields",
    "streaming_torch_save_reason",
    "torch_save_without_zip_crc",
]
