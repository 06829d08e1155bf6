"""`CheckpointManager`: one directory per step, one `latest` pointer, retention, autoresume.

- `manager`: `CheckpointManager`, which holds where its steps live (a tier) and its policies;
- `single_root`: the `Tier` protocol every tier implements and `SingleRoot`, the tier of one
  root (a directory or a bucket prefix); the cluster tier is in `cluster/`;
- `options`: the option objects (`Cluster`, `Preemption`, `InitialLoad`), checked before the
  manager touches anything, and the choice of tier;
- `policies`: save policies (`EveryNSteps`, `EveryNSeconds`, `FinalStep`) and retention policies
  (`KeepLast`, `KeepBest`, `KeepEvery`), combinable with `|`;
- `root_load`: loading one step of a root while others may delete it, and the initial load;
- `arguments`: the arguments of the manager's collective calls agreed on every rank (step,
  `overwrite`, `dry_run`: RanksDisagreeError on every rank where they differ);
- `fresh_start`: nothing to resume where the root looks mistyped (a warning; `require=True`);
- `lock`: the root lock, one writer at a time; `cleanup`: which step directories retention and
  debris removal delete; `preemption`: a termination signal remembered, so the loop can save;
- `local_budget`: what a node's root holds, reported and bounded (the in-memory tier's bound,
  `Cluster(max_local_bytes=...)`, and `memory_root`);
- `cluster/`: node-local roots, peer replicas and a remote."""
