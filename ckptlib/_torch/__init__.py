"""Everything ckptlib needs from torch beyond its public API, in one place.

No other ckptlib module touches a private torch name (tests/test_structure.py checks). Each
module here has one job and tests for the feature itself (an attribute, an import, a
signature, a behaviour) rather than a version string, so backports and nightlies are judged
by what they can do. The supported window is torch 2.6 to the newest release.

- `probes`: where this torch keeps DTensor, which devices and backends it has;
- `dcp_shims`: torch.distributed.checkpoint's helpers and signatures as ckptlib calls them;
- `dcp_extensions`: DCP's stream extensions (experimental in torch);
- `module_keys`: the key names a module's own `state_dict()` gives, as torch's helpers would;
- `serialization`: torch.load's defaults and torch.save's zip writer (and its path saves, for
  the crash harness);
- `c10d`: the default process group's store;
- `parallel`: FSDP, FSDP2, DTensor and device-mesh gates for the test matrix (`ckptlib.testing`);
- `report`: `describe()`, every probe's answer (tox prints it, ci/compat_table.py records it);
- `host_memory`: pinning shared staging memory for CUDA copies, a DTensor over a staged local tensor.
"""
