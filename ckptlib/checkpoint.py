"""`save`, `async_save` and `load`: collective, elastic, committed-or-nothing checkpoints.

Every rank calls them (or a single process without a process group). Errors are raised
on every rank alike, and a failed save never touches a committed checkpoint. The saves live
in `ckptlib.saving` (one `SaveTransaction` each, see `ckptlib.format.transaction`), the load
in `ckptlib.loading`; this module keeps the names users import from it.
"""

from __future__ import annotations

from .loading import LoadResult, load
from .saving import SaveResult, async_save, save, start_async_save

__all__ = ["LoadResult", "SaveResult", "async_save", "load", "save", "start_async_save"]
