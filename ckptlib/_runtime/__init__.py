"""What every collective operation runs on: agreement rounds, teardown, the gc pause, logging.

- `agree`: the collectives that make one rank's failure an error on every rank, never a hang
  (agreement rounds, broadcasts, the rank-loss guard);
- `check_in`: a public collective call checks that every rank makes it (fails in seconds);
- `teardown`: `exit_barrier()`, leaving a process group safely;
- `world`: the torch.distributed world ckptlib's per-process caches belong to (a new one after
  `destroy_process_group()` + `init_process_group()` resets them), and groups of a world left behind;
- `gc_pause`: Python's cyclic collector paused for the length of a save or load;
- `observe`: one INFO line per checkpoint operation on the `ckptlib` logger, and the metrics
  callbacks (`on_metrics`);
- `progress`: the progress of a save or load on rank 0 (`progress=`).
"""
