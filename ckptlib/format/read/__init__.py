"""Reading a checkpoint: DCP's StorageReader over a ckptlib Storage and the schedule of a load's reads.

- `planned_reader`: the StorageReader base of every reader; `dcp_reader`: the native reader,
  verifying each item it reads against the manifest; `load_planner`: DCP's planner, safe to unpickle;
  `chunk_index`: a rank's reads of a tensor at the cost of the saved chunks it reads;
- `copies`: which copy of each file a rank reads from, in order;
- `read_schedule`: which rank reads each stored item and whom it sends it to (read once);
  `shared_reads`: one rank's rounds of those reads; `direct_reads`: zero-copy reads of large items.
"""
