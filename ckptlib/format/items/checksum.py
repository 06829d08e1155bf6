"""CRC-32 (the zlib/zip polynomial) for the manifest: the fastest implementation installed.

zlib-ng's crc32 (the `zlib-ng` package, a dependency of ckptlib) runs at ~14
GiB/s on the dev box against ~1.1 GiB/s for the standard library's zlib 1.2.13; both give
identical values and both release the GIL. With zlib-ng, `crc32_combine` gives a file's
CRC from its items' without a second pass over the bytes. An environment without zlib-ng
(installed with --no-deps) still works on the standard zlib: no block checksums, and
`crc32_combine` is None.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

crc32: Callable[..., int]
crc32_combine: Optional[Callable[[int, int, int], int]]

try:  # pragma: no cover - depends on the install
    from zlib_ng.zlib_ng import crc32 as crc32
    from zlib_ng.zlib_ng import crc32_combine as crc32_combine

    FAST = True
except ImportError:  # pragma: no cover
    crc32 = zlib.crc32
    crc32_combine = None
    FAST = False
