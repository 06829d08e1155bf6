"""The rounds of a load's shared reads on one rank (`read_schedule.RankRole`): read the blocks
(adjacent stored items) this rank reads for several ranks, hand their raw bytes to the others,
and apply the items this rank needs, verified and decoded exactly as if it had read them itself.

No collectives here: the bytes travel through a `Transport` (`ckptlib.loading.read_exchange` gives
point-to-point messages on a dedicated gloo group). Every rank takes part in every round it is
in whatever fails: a reader whose copies all failed still sends (a failure flag instead of
the item), an item that fails to apply is held, and this rank's first failure is raised only
after its last round, so no peer is ever left waiting for a message that will not come (the
load then fails on every rank, through DCP's gathering of read failures).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from torch.distributed.checkpoint.planner import LoadPlanner

from ckptlib.errors import CheckpointCorruptError, CheckpointError
from ckptlib.format.native.file_names import whose
from ckptlib.format.read.read_schedule import Block, ItemKey, RankRole, block_span


class Transport(Protocol):
    """Point-to-point delivery of one round's blocks (see `ckptlib.loading.read_exchange.GlooTransport`)."""

    def run_round(
        self, sends: Sequence[tuple[int, memoryview | None, int]], recvs: Sequence[tuple[int, int]]
    ) -> list[memoryview | None]:
        """Send each (destination rank, block bytes or None for "could not read it", length)
        and receive each (source rank, length); returns the received blocks in `recvs` order,
        None where the source could not read it. Blocks between two ranks keep their order."""


def _unserved(reader: Any, block: Block) -> CheckpointError:
    name, offset, _ = block_span(block)
    where = f"{reader.storage.uri}/{name}"
    err = CheckpointCorruptError(
        f"{where}: items at offset {offset}{whose(name)}: rank {block[0]}, which reads them for this rank, could not "
        "read them",
        path=where,
    )
    err.secondary = True  # the reader raises the real error; `read_exchange.load_failure` prefers it
    return err


def _apply(
    reader: Any,
    block: Block,
    data: memoryview,
    wanted: dict[ItemKey, list[Any]],
    planner: LoadPlanner,
    errors: list,
    *,
    check: bool,
) -> None:
    """Apply the items of `block` (its bytes `data`) that this rank needs, each verified first
    when it came from another rank (the reader verified its own as it read them)."""
    start = block[2][0][1]
    for key in block[2]:
        reqs = wanted.get(key)
        if not reqs:
            continue
        item = data[key[1] - start : key[1] - start + key[2]]
        try:
            if check:
                reader.check_received(key[0], key[1], item)
            for req, info in reqs:
                reader._apply(key[0], req, info, item, planner)
        except Exception as exc:  # noqa: BLE001 - held: raised after the last round
            errors.append(exc)


def read_shared(
    reader: Any, role: RankRole, wanted: dict[ItemKey, list[Any]], planner: LoadPlanner, transport: Transport
) -> None:
    """Run this rank's rounds; `wanted` maps each shared item this rank needs to its requests."""
    errors: list[BaseException] = []
    for part in role.rounds:
        held: list[memoryview | None] = []
        for block in part.out:
            try:
                held.append(reader.fetch_block(block[2]))
            except Exception as exc:  # noqa: BLE001 - the receivers are told; raised after the last round
                errors.append(exc)
                held.append(None)
        sends = [(dst, data, block_span(block)[2]) for block, data in zip(part.out, held) for dst in block[1]]
        got = transport.run_round(sends, [(block[0], block_span(block)[2]) for block in part.into])
        try:
            for block, data in zip(part.out, held):
                if data is not None:
                    _apply(reader, block, data, wanted, planner, errors, check=False)
            held.clear()
            for block, data in zip(part.into, got):
                if data is None:
                    errors.append(_unserved(reader, block))
                    continue
                reader.bytes_received += len(data)
                _apply(reader, block, data, wanted, planner, errors, check=True)
        except Exception as exc:  # noqa: BLE001 - held: the next rounds still run
            errors.append(exc)
        del got
    if errors:
        raise next((e for e in errors if not getattr(e, "secondary", False)), errors[0])


__all__ = ["Transport", "read_shared"]
