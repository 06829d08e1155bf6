"""`CheckpointManager`: one directory per step, one `latest` pointer, retention, autoresume.

- `manager`: `CheckpointManager`, which holds where its steps live (a single root or the cluster
  tier in `cluster/`) and its policies;
- `manager_options`: its options, checked before it touches anything;
- `policies`: save policies (`EveryNSteps`, `EveryNSeconds`, `FinalStep`) and retention policies
  (`KeepLast`, `KeepBest`, `KeepEvery`), combinable with `|`;
- `root_load`: loading one step of a root while others may delete it, and the initial load;
- `lock`: the root lock, one writer at a time; `cleanup`: which step directories retention and
  debris removal delete; `preemption`: a termination signal remembered, so the loop can save.
- `cluster/`: node-local roots, peer replicas and a remote.
"""
