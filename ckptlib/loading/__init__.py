"""`load`: fill a state from any checkpoint ckptlib reads, at any world size.

- `loading`: `load` and `LoadResult`, collective in three steps (inspect, check, read);
- `load_checks`: the checks each rank computes on its own (keys, shapes, dtype conversions);
- `load_keys`: which keys a load fills and under which checkpoint keys (`only=`, `ignore_keys=`, `rename=`);
- `read_cost`: whether a load reads once (`read_once="auto"`: object stores, network
  filesystems and copies yes, a local disk no);
- `read_exchange`: read once, exchange over the process group (the transport of shared reads).
"""
