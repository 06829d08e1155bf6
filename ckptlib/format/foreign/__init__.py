"""Checkpoints ckptlib reads (and writes on export) that are not its own: each format's reader and writer in one file.

- `foreign`: what the foreign readers share (`SourceInfo`, the locators of tensor pieces);
- `torch_save`: torch.save files read as a DCP source and written one tensor at a time, through
  `torch_archive` (torch.save's archive of a flat dict, streamed);
- `v0`: the per-rank format of older trainers;
- `safetensors`: safetensors files and shards, read with ranged reads and written;
  `safetensors_header` parses and validates their headers, `safetensors_hf` the Hugging Face side
  files and tied weights, `shard_files` Hugging Face's sharded file layout and index.
"""
