"""Read once at 4 ranks: the bytes all ranks together read from storage are at most 1.1x the bytes
the load needs, for DDP, HSDP (2x2) and FSDP2+TP (2x2), on local disk and on S3 (moto), with the
state bit-exact; and the negative control: with `read_once=False` (every rank reads what it
needs itself, as plain DCP does) the same loads read about as many times the bytes as there
are replicas; the default (`read_once="auto"`) does the first on S3 and the second on a local
disk. On S3 the bytes are counted twice: by `LoadResult` and by the GETs each rank made.
"""

from __future__ import annotations

import pytest

from ckptlib.testing.fakes.s3_server import s3_env
from ckptlib.testing.matrices import layout_matrix as lm
from ckptlib.testing.matrices import matrix as mx
from ckptlib.testing.matrices import parallel_layouts as lay

pytestmark = [
    pytest.mark.elastic,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

WORLD = 4
# Bytes read without read-once, as a multiple of the bytes needed, at least: DDP's state is on
# every rank, HSDP's shards on both replicas; FSDP2+TP shares its replicated items (norms,
# optimizer steps, param groups) only.
WITHOUT = {"ddp": 3.5, "hsdp": 1.8, "fsdp2+tp": 1.3}


def _load_reporting(uri: str, layout: str, expected: dict, read_once: bool | str, count_gets: bool) -> dict:
    """A rank: load at `layout`, compare with `expected`, and report what it read (and, on S3,
    the shard-file bytes its GETs returned)."""
    import torch.distributed as dist

    import ckptlib

    gets: list[tuple[str, int]] = []
    client = None
    if count_gets:
        from ckptlib.storage.s3 import default_client

        def record(http_response, parsed, model, **kwargs):
            if model.name == "GetObject" and http_response.status_code in (200, 206):
                gets.append((http_response.url.rsplit("/", 1)[-1].split("?")[0], int(parsed.get("ContentLength") or 0)))

        client = default_client()
        client.meta.events.register("after-call.s3.GetObject", record, unique_id="read-once-gets")
    try:
        model, opt = lm.build(lm.TRANSFORMER, layout, "adamw", seed=1)
        state = {"model": model, "optim": opt, "step": -1}
        result = ckptlib.load(uri, state, read_once=read_once)
    finally:
        if client is not None:
            client.meta.events.unregister("after-call.s3.GetObject", unique_id="read-once-gets")
    problems = mx.differences(expected, lm.full_state(model, opt), "after-load")
    if state["step"] != 2:
        problems.append(f"step {state['step']!r}")
    return {
        "rank": dist.get_rank(),
        "problems": problems,
        "read": result.storage_bytes_read,
        "by_rank": result.storage_bytes_read_by_rank,
        "by_source": result.bytes_by_source,
        "received": result.bytes_received,
        "needed": result.bytes_needed,
        "read_once": result.read_once,
        "shard_gets": sum(n for name, n in gets if name.endswith(".distcp")),
    }


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
@pytest.mark.parametrize("layout", list(WITHOUT))
def test_read_once_sums(layout, where, tmp_path, dist_run, request):
    reason = lay.get_layout(layout).unavailable_reason("cpu")
    if reason:
        pytest.skip(f"{layout}: {reason}")
    env = {}
    if where == "s3":
        uri = request.getfixturevalue("s3_root")
        env = {"env": s3_env(request.getfixturevalue("moto_server"))}
    else:
        uri = str(tmp_path / "c")
    expected = dist_run(WORLD, lm.save_layout, uri, layout, **env)[0]

    once = dist_run(WORLD, _load_reporting, uri, layout, expected, True, where == "s3", **env)
    for r in once:
        assert r["problems"] == [], f"rank {r['rank']}: {r['problems']}"
    needed, by_rank = once[0]["needed"], once[0]["by_rank"]
    assert all(r["by_rank"] == by_rank and r["needed"] == needed for r in once)
    assert [r["read"] for r in once] == by_rank
    assert 0.99 * needed <= sum(by_rank) <= 1.1 * needed, (by_rank, needed)
    label = "remote" if where == "s3" else "local"
    assert once[0]["by_source"] == {label: sum(by_rank)}
    assert sum(r["received"] for r in once) > 0
    if where == "s3":  # what LoadResult says each rank read is what its GETs returned
        assert [r["shard_gets"] for r in once] == by_rank

    # The negative control: every rank reads all it needs itself.
    every = dist_run(WORLD, _load_reporting, uri, layout, expected, False, where == "s3", **env)
    for r in every:
        assert r["problems"] == [], f"rank {r['rank']}: {r['problems']}"
    assert all(r["received"] == 0 for r in every) and every[0]["needed"] == needed
    assert sum(every[0]["by_rank"]) >= WITHOUT[layout] * needed, (every[0]["by_rank"], needed)
    if where == "s3":
        assert [r["shard_gets"] for r in every] == every[0]["by_rank"]

    # The default (read_once="auto") reads once from S3 and directly from a local disk.
    default = dist_run(WORLD, _load_reporting, uri, layout, expected, "auto", False, **env)
    for r in default:
        assert r["problems"] == [], f"rank {r['rank']}: {r['problems']}"
    assert [r["read_once"] for r in once + every] == [True] * WORLD + [False] * WORLD
    assert [r["read_once"] for r in default] == [where == "s3"] * WORLD
    reads = [r["read"] for r in default]
    if where == "s3":
        assert 0.99 * needed <= sum(reads) <= 1.1 * needed and sum(r["received"] for r in default) > 0, reads
    else:
        assert reads == every[0]["by_rank"] and all(r["received"] == 0 for r in default), reads
