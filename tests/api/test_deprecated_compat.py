"""ckptlib.compat, deprecated for one release: torch's private names and probes moved to
ckptlib._torch, the streaming archive writer to ckptlib.format.foreign.torch_archive. The old module
still answers with the same objects and warns where it is imported (a fresh process each
time: a module warns only when it is first imported)."""

from __future__ import annotations

import json
import subprocess
import sys

#: Every public name ckptlib/compat.py defined before the move, but the two nothing used
#: (torch_version, check_torch_supported), which are gone.
OLD_NAMES = (
    "MIN_TORCH TorchArchiveWriter checkpoint_exception_cls checkpoint_wrapper_fn create_write_items cuda_available "
    "current_pickle_module dcp_accepts dcp_failures dcp_load_no_dist dcp_parameters dcp_save_no_dist "
    "dedup_save_plans default_store describe distribute_locally dtensor_api dtensor_cls dtensor_module_name "
    "flatten_state_dict flatten_state_dict_pre_2_4 fsdp1_cpu_reason fsdp2_cpu_reason fsdp2_reason fully_shard_fn "
    "gloo_available has_safe_globals init_device_mesh_fn layout_gap_reason load_weights_only_default "
    "meta_load_records_offsets meta_storage_offset nccl_available quiet_single_process require_fsdp2_cpu "
    "set_element storage_info_cls storage_info_fields streaming_torch_save_reason torch_save_without_zip_crc"
).split()

SCRIPT = r"""
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import ckptlib
    imported_by_package = "ckptlib.compat" in sys.modules
    compat = ckptlib.compat  # resolves lazily after a bare `import ckptlib`
from ckptlib._torch import c10d, dcp_shims, parallel, probes, report, serialization
from ckptlib.format import torch_archive

homes = (c10d, dcp_shims, parallel, probes, report, serialization, torch_archive)
moved = {name: [m.__name__ for m in homes if getattr(m, name, None) is getattr(compat, name)]
         for name in compat.__all__}
print(json.dumps({
    "imported_by_package": imported_by_package,
    "warnings": [(w.category.__name__, str(w.message), w.filename, w.lineno)
                 for w in caught if "compat" in str(w.message)],
    "moved": moved,
    "dead_names_left": [n for n in ("torch_version", "check_torch_supported") if hasattr(compat, n)],
    "describe_same": compat.describe() == report.describe(),
}))
"""


def test_compat_warns_at_the_importers_line_and_reexports_the_moved_names(tmp_path):
    script = tmp_path / "user_code.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["imported_by_package"] is False
    [(category, message, filename, lineno)] = got["warnings"]
    assert category == "DeprecationWarning"
    assert "ckptlib.compat is deprecated" in message and "ckptlib._torch" in message
    assert (filename, lineno) == (
        str(script),
        SCRIPT.splitlines().index("    compat = ckptlib.compat  # resolves lazily after a bare `import ckptlib`") + 1,
    )
    assert sorted(got["moved"]) == sorted(OLD_NAMES)
    assert [name for name, homes in got["moved"].items() if not homes] == []  # the very objects of the new homes
    assert got["dead_names_left"] == []
    assert got["describe_same"] is True


def test_an_import_statement_warns_under_pythons_default_filters(tmp_path):
    """Python shows a DeprecationWarning by default only where `__main__` triggers it: the
    warning must be attributed to the importing line, not to importlib."""
    script = tmp_path / "user_code.py"
    script.write_text("import ckptlib.compat\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{script}:1: DeprecationWarning: ckptlib.compat is deprecated" in done.stderr
