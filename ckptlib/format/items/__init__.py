"""One stored tensor item's bytes: encoding, decoding, checksums, ranged reads.

- `item_encoder` / `item_decoder`: a tensor item's torch.save bytes written with one CRC pass and
  read without torch.load, trusted only where its header (`item_header`) agrees with `.metadata`;
- `zip_directory`: where records lie in a torch.save archive, from its central directory;
- `checksum`: the fastest CRC-32 installed; `block_checks`: per-item and per-block checksums
  computed while shard files are written and read;
- `ranged_io`: ranged reads into tensor memory, coalesced into few requests;
- `tensor_kinds`: the tensors ckptlib stores (dense, whole-byte elements); others are refused.
"""
