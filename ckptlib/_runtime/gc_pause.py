"""Python's cyclic garbage collector paused for the length of a save or load.

A save or load of N tensors makes a few hundred thousand short-lived objects (DCP's plans,
their pickles, Metadata). Each 700 allocations start a young-generation collection, and every
tenth of those an older one that walks the whole heap, which in a training process holds
every parameter's Python objects: at 10,000 tensors over 2 ranks collections were 3/4 of a
save's time. The objects are freed by reference counting as usual; only reference cycles made
meanwhile wait until the collector runs again after the operation (torchtitan and Composer
control the collector around training steps for the same reason).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collections inside; nested and concurrent uses (a background save next to a
    load) restore the collector's state once the last one leaves."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


__all__ = ["gc_paused"]
