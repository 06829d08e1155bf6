"""Per-item cost of small tensors (issue 13), each path against the one it replaced, same
tensors, interleaved in one process:

- save: torch.save into one buffer + one CRC-32 (the writer's small-item path before) against
  the template per signature (`item_encoder.small_item_bytes`) + one CRC-32 (now); the
  single-pass encoder of large items is shown too;
- load: torch.load of the item's bytes (before) against one parse of its zip directory
  (`zip_directory.tensor_layout`), its header checked (`pickled_tensor_header`, cached per
  header as the reader does) and a tensor over its bytes, as `DeclaredChunks.decode_plain`
  does (now).

Run: python -m ckptlib.bench.small_items [--layers 100] [--reps 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time

import torch

from ckptlib.format.items import item_encoder, zip_directory
from ckptlib.format.items.checksum import crc32
from ckptlib.format.items.item_header import pickled_tensor_header


def transformer_tensors(layers: int, hidden: int = 64) -> list[torch.Tensor]:
    """A transformer's parameters (attention, MLP, norms, biases) and both Adam moments."""
    params = []
    for _ in range(layers):
        params += [torch.randn(hidden, hidden) for _ in range(4)]
        params += [torch.randn(2 * hidden, hidden), torch.randn(hidden, 2 * hidden), torch.randn(2 * hidden, hidden)]
        params += [torch.ones(hidden) for _ in range(11)]
    return params + [torch.randn_like(p) for p in params] + [torch.rand_like(p) for p in params]


def _decode(blob: memoryview, headers: dict) -> torch.Tensor:
    layout = zip_directory.tensor_layout(blob)
    if layout.pickle not in headers:
        headers[layout.pickle] = pickled_tensor_header(layout.pickle)
    dtype, shape, _, _ = headers[layout.pickle]
    return torch.frombuffer(blob[layout.data_start : layout.data_start + layout.data_size], dtype=dtype).view(shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptlib.bench.small_items", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    tensors = transformer_tensors(args.layers)
    blobs = [memoryview(bytearray(item_encoder.torch_save_bytes(t))) for t in tensors]
    for tensor, blob in zip(tensors, blobs):  # the paths compared give the same bytes and tensors
        assert bytes(item_encoder.small_item_bytes(tensor)) == bytes(blob)
        assert torch.equal(_decode(blob, {}), tensor)
    paths = {
        "save: encoder": lambda: [item_encoder.encode(t) for t in tensors],
        "save: torch.save + CRC (before)": lambda: [crc32(item_encoder.torch_save_bytes(t)) for t in tensors],
        "save: template + CRC (now)": lambda: [crc32(item_encoder.small_item_bytes(t)) for t in tensors],
        "load: torch.load (before)": lambda: [torch.load(io.BytesIO(b), weights_only=True) for b in blobs],
        "load: directory parse (now)": lambda: (lambda headers: [_decode(b, headers) for b in blobs])({}),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.reps):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"tensors={len(tensors)} reps={args.reps}; per item, median (ms):")
    for name, values in times.items():
        print(f"  {name:<34} {statistics.median(values) / len(tensors) * 1e3:.3f}")
    for op, before, now in (
        ("save", "save: torch.save + CRC (before)", "save: template + CRC (now)"),
        ("load", "load: torch.load (before)", "load: directory parse (now)"),
    ):
        print(f"{op}: now / before = {statistics.median(times[now]) / statistics.median(times[before]):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
