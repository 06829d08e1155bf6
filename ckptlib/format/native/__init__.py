"""ckptlib's own checkpoints: the manifest, what a directory and a root are, and how their files go.

- `manifest`: the manifest written last, which makes a checkpoint directory committed;
- `layout`: what a checkpoint directory is (committed, incomplete, plain DCP) and the commit protocol;
- `root`: what a manager root holds: its step directories and the step `latest` names;
- `deletion`: deleting only the files ckptlib or DCP wrote; `file_names`: DCP's shard file names;
- `structure`: consistency checks of DCP's `.metadata`; `safe_pickle`: its restricted unpickling;
- `aliases`: tied tensors stored once; `stream_transforms`: DCP's stream extensions (zstd);
- `plan_codec`: compact pickling of the plans DCP sends between ranks.
"""
