"""Copies PyTorch's DCP test files into a directory, forcing the GPU-gated ones onto CPU.

`skip_if_lt_x_gpu(N)` becomes `skip_if_lt_x_gpu(N, allow_cpu=True)` (the decorator's own CPU
switch, torch >= 2.9): DTensorTestBase then runs N gloo ranks on CPU. It must be a change of the
source, not a monkeypatch: every rank is a fresh interpreter that re-imports the module.
test_format_utils.py keeps its gate: its gated test needs CUDA itself (`.cuda()`, FSDP1).

    python cpu_variants.py UPSTREAM_DIR OUT_DIR FILE...
"""

import pathlib
import re
import sys

KEEP_GATED = {"test_format_utils.py"}


def main(upstream: str, out: str, names: list[str]) -> None:
    target = pathlib.Path(out)
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        text = (pathlib.Path(upstream) / name).read_text()
        if name not in KEEP_GATED:
            text = re.sub(r"skip_if_lt_x_gpu\((\d+)\)", r"skip_if_lt_x_gpu(\1, allow_cpu=True)", text)
        (target / name).write_text(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
