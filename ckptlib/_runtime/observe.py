"""One INFO line per checkpoint operation on `logging.getLogger("ckptlib")`.

Every save, load, export and gc logs, on rank 0 only, what it moved and how fast:

    save step=200 bytes=1073741824 seconds=2.104 MiB/s=486.7 world_size=4 uri=/ckpt/step_0000000200
    save step=300 ... world_size=4 async blocked_seconds=0.081 uri=...   (seconds = total)

The same figures ride on the record as `record.ckptlib` (a dict), so log processors and
tests read them without parsing the text. `on_metrics(fn)` hands them to `fn(scalars, step)`
as flat scalars named for TensorBoard and W&B (`ckpt/save_seconds`, `ckpt/load_bytes_remote`,
...), whatever the logger's level; a callback that raises is warned about, never fails the
operation.
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any, Callable, Mapping

from ckptlib._scrub import logger as scrubbed_logger

logger = scrubbed_logger("ckptlib")  # its records are scrubbed of credentials, as every storage module's

MIB = 1 << 20
PREFIX = "ckpt/"

MetricsCallback = Callable[[dict[str, float], "int | None"], None]
_callbacks: list[MetricsCallback] = []
_callbacks_lock = threading.Lock()


class MetricsCallbackWarning(UserWarning):
    """A metrics callback (`ckptlib.on_metrics`) raised; the operation it reported succeeded."""


def on_metrics(fn: MetricsCallback) -> Callable[[], None]:
    """Call `fn(scalars, step)` on rank 0 after every save, load, upload, export and gc:
    `scalars` maps `ckpt/<op>_<figure>` to a number (seconds, bytes, MiB/s, blocked seconds,
    bytes by source), ready for `SummaryWriter.add_scalar(name, value, step)` or
    `wandb.log(scalars, step=step)`. Returns a function that removes `fn` again."""
    if not callable(fn):
        from ckptlib.errors import StateError

        raise StateError(f"on_metrics needs a callable, got {type(fn).__name__} {fn!r}")
    with _callbacks_lock:
        _callbacks.append(fn)

    def remove() -> None:
        with _callbacks_lock:
            if fn in _callbacks:
                _callbacks.remove(fn)

    return remove


def scalars(fields: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one operation's fields (`record.ckptlib`) as flat named scalars."""
    op = fields["op"]
    out: dict[str, float] = {}
    for key, value in fields.items():
        if key in ("op", "step", "uri", "async") or isinstance(value, bool):
            continue
        if isinstance(value, Mapping):  # bytes by source: one scalar per label
            for label, n in value.items():
                if isinstance(n, (int, float)) and not isinstance(n, bool):
                    out[f"{PREFIX}{op}_{key}_{label}"] = float(n)
        elif isinstance(value, (int, float)):
            out[f"{PREFIX}{op}_{key}"] = float(value)
    return out


def _report(fields: dict[str, Any]) -> None:
    with _callbacks_lock:
        callbacks = list(_callbacks)
    if not callbacks:
        return
    numbers = scalars(fields)
    for fn in callbacks:
        try:
            fn(dict(numbers), fields.get("step"))
        except Exception as exc:  # noqa: BLE001 - a reporting failure never fails a checkpoint
            warnings.warn(
                f"the metrics callback {getattr(fn, '__qualname__', fn)!r} raised {type(exc).__name__}: {exc} "
                f"(reporting {fields['op']} of {fields.get('uri')})",
                MetricsCallbackWarning,
                stacklevel=2,
            )


def mib_per_s(nbytes: int | None, seconds: float | None) -> float | None:
    if nbytes is None or not seconds or seconds <= 0:
        return None
    return nbytes / MIB / seconds


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if value < 1000 else f"{value:.1f}"
    return str(value)


def log_operation(
    op: str,
    *,
    uri: str,
    step: int | None,
    nbytes: int | None,
    seconds: float,
    world_size: int | None,
    blocked_seconds: float | None = None,
    rank: int = 0,
    **extra: Any,
) -> None:
    """Log `op` (save, load, export, gc) on rank 0: step, bytes, seconds, MiB/s, world size,
    and for async saves the seconds the caller was blocked (`seconds` is then the total);
    `extra` figures a mapping holds (bytes by source) go to the record and the metrics only."""
    if rank != 0 or not (_callbacks or logger.isEnabledFor(logging.INFO)):
        return
    fields: dict[str, Any] = {
        "op": op,
        "step": step,
        "bytes": nbytes,
        "seconds": seconds,
        "mib_per_s": mib_per_s(nbytes, seconds),
        "world_size": world_size,
    }
    if blocked_seconds is not None:
        fields["async"] = True
        fields["blocked_seconds"] = blocked_seconds
    fields.update(extra)
    fields["uri"] = uri
    _report(fields)
    if not logger.isEnabledFor(logging.INFO):
        return
    text = " ".join(
        f"{'MiB/s' if k == 'mib_per_s' else k}={_fmt(v)}"
        for k, v in fields.items()
        if k not in ("op", "async") and not isinstance(v, Mapping)
    )
    if blocked_seconds is not None:
        text = text.replace(" blocked_seconds=", " async blocked_seconds=", 1)
    logger.info("%s %s", op, text, extra={"ckptlib": fields})


__all__ = ["MetricsCallbackWarning", "log_operation", "logger", "mib_per_s", "on_metrics", "scalars"]
