"""The rounds of a load's shared reads on one rank (`read_schedule.RankRole`): read the items
this rank reads for several ranks, hand their raw bytes to the others, and apply what this
rank needs of them, verified and decoded exactly as if it had read them itself.

No collectives here: the bytes travel through a `Transport` (`ckptlib.read_exchange` gives
point-to-point messages on a dedicated gloo group). Every rank takes part in every round it is
in whatever fails: a reader whose copies all failed still sends (a failure flag instead of
the item), an item that fails to apply is held, and this rank's first failure is raised only
after its last round, so no peer is ever left waiting for a message that will not come (the
load then fails on every rank, through DCP's gathering of read failures).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol, Sequence

from torch.distributed.checkpoint.planner import LoadPlanner

from ..errors import CheckpointCorruptError, CheckpointError
from .file_names import whose
from .read_schedule import ItemKey, RankRole


class Transport(Protocol):
    """Point-to-point delivery of one round's items (see `ckptlib.read_exchange.GlooTransport`)."""

    def run_round(
        self, sends: Sequence[tuple[int, memoryview | None, int]], recvs: Sequence[tuple[int, int]]
    ) -> list[memoryview | None]:
        """Send each (destination rank, item bytes or None for "could not read it", length) and
        receive each (source rank, length); returns the received items in `recvs` order, None
        where the source could not read it. Items between two ranks arrive in the order sent."""


def _by_file(keys: Sequence[ItemKey]) -> dict[str, list[ItemKey]]:
    grouped: dict[str, list[ItemKey]] = defaultdict(list)
    for key in keys:
        grouped[key[0]].append(key)
    return grouped


def _unserved(reader: Any, key: ItemKey, src: int) -> CheckpointError:
    where = f"{reader.storage.uri}/{key[0]}"
    err = CheckpointCorruptError(
        f"{where}: item at offset {key[1]}{whose(key[0])}: rank {src}, which reads it for this rank, could not read it",
        path=where,
    )
    err.secondary = True  # the reader raises the real error; `read_exchange.load_failure` prefers it
    return err


def _apply(reader: Any, key: ItemKey, data: memoryview, reqs: list[Any], planner: LoadPlanner, errors: list) -> None:
    try:
        for req, info in reqs:
            reader._apply(key[0], req, info, data, planner)
    except Exception as exc:  # noqa: BLE001 - held: raised after the last round
        errors.append(exc)


def read_shared(
    reader: Any, role: RankRole, wanted: dict[ItemKey, list[Any]], planner: LoadPlanner, transport: Transport
) -> None:
    """Run this rank's rounds; `wanted` maps each shared item this rank needs to its requests."""
    errors: list[BaseException] = []
    for part in role.rounds:
        held: dict[ItemKey, memoryview | None] = {}
        for name, keys in _by_file(part.reads).items():
            try:
                held.update(reader.fetch_items(name, keys))
            except Exception as exc:  # noqa: BLE001 - the receivers are told; raised after the last round
                errors.append(exc)
            for key in keys:
                held.setdefault(key, None)
        sends = [(dst, held[key], key[2]) for key, dsts in part.sends for dst in dsts]
        got = transport.run_round(sends, [(src, key[2]) for key, src in part.recvs])
        for key in part.reads:
            data = held[key]
            if data is not None and key in wanted:
                _apply(reader, key, data, wanted[key], planner, errors)
        held.clear()
        for (key, src), data in zip(part.recvs, got):
            if data is None:
                errors.append(_unserved(reader, key, src))
                continue
            reader.bytes_received += len(data)
            try:
                reader.check_received(key[0], key[1], data)
            except Exception as exc:  # noqa: BLE001 - held: raised after the last round
                errors.append(exc)
                continue
            _apply(reader, key, data, wanted.get(key, []), planner, errors)
        del got
    if errors:
        raise next((e for e in errors if not getattr(e, "secondary", False)), errors[0])


__all__ = ["Transport", "read_shared"]
