"""Writing a checkpoint: one save into a directory, committed or nothing.

- `transaction`: `SaveTransaction`, the object every native save goes through (prepare, write,
  commit, clean up);
- `dcp_writer`: DCP's StorageWriter over a ckptlib Storage, in DCP's own file layout;
- `save_planner`: DCP's save planner with a near-linear global check; `plan_agreement`: what the
  ranks of one save must agree on, checked on the coordinator; `plan_cache`: plans reused while
  the state's structure is unchanged.
"""
