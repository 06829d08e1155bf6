"""Per-item write cost of small tensors (issue 13): the single-pass item encoder against the
writer's small-item path (torch.save into one buffer + one CRC-32), same tensors, interleaved.

Run: python -m benchmarks.small_items [--layers 100] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ckptlib.format import item_encoder
from ckptlib.format.checksum import crc32


def transformer_tensors(layers: int, hidden: int = 64) -> list[torch.Tensor]:
    """A transformer's parameters (attention, MLP, norms, biases) and both Adam moments."""
    params = []
    for _ in range(layers):
        params += [torch.randn(hidden, hidden) for _ in range(4)]
        params += [torch.randn(2 * hidden, hidden), torch.randn(hidden, 2 * hidden), torch.randn(2 * hidden, hidden)]
        params += [torch.ones(hidden) for _ in range(11)]
    return params + [torch.randn_like(p) for p in params] + [torch.rand_like(p) for p in params]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.small_items", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    tensors = transformer_tensors(args.layers)
    encoder, small = [], []
    for _ in range(args.reps):
        start = time.perf_counter()
        for tensor in tensors:
            item_encoder.encode(tensor)
        encoder.append(time.perf_counter() - start)
        start = time.perf_counter()
        for tensor in tensors:
            crc32(item_encoder.torch_save_bytes(tensor))
        small.append(time.perf_counter() - start)
    e, s = statistics.median(encoder), statistics.median(small)
    print(f"tensors={len(tensors)} reps={args.reps}")
    print(f"encoder s: {[round(x, 2) for x in encoder]}  small-item path s: {[round(x, 2) for x in small]}")
    print(f"per item (median): encoder {e / len(tensors) * 1e3:.3f} ms, small-item path {s / len(tensors) * 1e3:.3f} ms, "
          f"ratio {s / e:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
