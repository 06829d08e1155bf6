"""The cluster tier: node-local roots, peer replicas, a remote.

- `cluster_tier`: the tier a CheckpointManager holds for `replicas=` / `remote=`;
- `topology`: which ranks share a node's local root; `node_save`: one save into node-local roots;
- `replication`: a node's shard files copied to its partner nodes through the process group;
- `remote_tier`: `RemoteTier`, every rank uploading its own files and one commit;
- `resume`: which step the tier resumes from and where its copies are (the inventory), and the
  load from the nearest intact copy;
- `remote_lag`: how far the remote may fall behind while unreachable before a save fails, and
  when an upload is tried again;
- `upkeep`: gc over every root, reporting each deletion, and the upload `wait()` / `close()`
  make of the newest step left local;
- `pointers`: a root's `latest` moved off a committed step before that step is replaced;
- `damaged`: a node's copy that a load or an upload found damaged is set aside, and its file
  uploaded from another node's copy.
"""
