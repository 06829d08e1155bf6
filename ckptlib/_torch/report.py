"""Every probe's answer in one JSON-serializable dict: tox prints it before each env's tests,
ci/compat_table.py records it next to each torch version's results, and bug reports quote it:

    python -c "from ckptlib._torch.report import describe; print(describe())"
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ckptlib._torch import dcp_shims, parallel, probes, serialization


def describe() -> dict[str, Any]:
    """Every probe's answer, JSON-serializable: for `tox`, bug reports and the compat table."""
    fully_shard = parallel.fully_shard_fn()
    return {
        "torch": torch.__version__,
        "supported": probes.version_tuple(torch.__version__) >= probes.MIN_TORCH,
        "cuda_build": torch.version.cuda,
        "cuda_available": probes.cuda_available(),
        "gloo": probes.gloo_available(),
        "nccl": probes.nccl_available(),
        "fully_shard": None if fully_shard is None else fully_shard.__module__,
        "fsdp2_cpu": parallel.fsdp2_cpu_reason() or "ok",
        "cpu_layout_gaps": {name: parallel.layout_gap_reason(name) or "ok" for name in parallel.LAYOUT_GAPS},
        "dtensor_module": probes.dtensor_module_name(),
        "storage_info_fields": list(dcp_shims.storage_info_fields()),
        "load_planner_allow_partial_load": dcp_shims.dcp_accepts("DefaultLoadPlanner", "allow_partial_load"),
        "dcp_no_dist": dcp_shims.dcp_accepts("save", "no_dist") and dcp_shims.dcp_accepts("load", "no_dist"),
        "async_save": dcp_shims.dcp_parameters("async_save") is not None,
        "async_save_stager": dcp_shims.dcp_accepts("async_save", "async_stager"),
        "storage_writer_setup": list(dcp_shims.dcp_parameters("set_up_storage_writer") or ()),
        "dcp_to_torch_save": dcp_shims.dcp_parameters("dcp_to_torch_save") is not None,
        "torch_load_weights_only_default": serialization.load_weights_only_default(),
        "meta_load_records_offsets": serialization.meta_load_records_offsets(),
        "zip_writer_without_crc": serialization.torch_save_without_zip_crc(torch.zeros(1), io.BytesIO()),
        "safe_globals": serialization.has_safe_globals(),
        "dcp_1_13_metadata_module": dcp_shims.current_pickle_module("torch.distributed._shard.checkpoint.metadata"),
    }
