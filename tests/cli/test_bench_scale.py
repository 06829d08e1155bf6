"""`ckpt bench scale` (ckptlib/bench/scale.py) at tiny sizes, so it cannot rot (no timings asserted)."""

from __future__ import annotations

import json
import pickle

import pytest

from ckptlib import cli
from ckptlib.bench import s3_requests, scale_cell
from ckptlib.format.native.manifest import Manifest
from ckptlib.format.write.plan_cache import PlanCache


@pytest.mark.parametrize("world, tensors", [(1, 1), (2, 3), (8, 20)], ids=["world1-t1", "world2-t3", "world8-t20"])
def test_records_cover_every_chunk_and_the_second_save_writes_the_same_metadata(world, tensors):
    names = scale_cell.tensor_names(tensors)
    plans = [scale_cell.rank_plan(world, names, rank) for rank in range(world)]
    results = [scale_cell.rank_results(world, names, rank) for rank in range(world)]
    cache = PlanCache()
    _, storage = scale_cell._first_save(world, names, plans, results, cache)
    metadata = pickle.loads(storage.files[".metadata"])
    assert sorted(metadata.state_dict_metadata) == sorted(names)
    assert all(len(md.chunks) == world for md in metadata.state_dict_metadata.values())
    assert len(metadata.storage_data) == world * tensors
    manifest = Manifest.from_bytes(storage.files["ckptlib.json"], "scale")
    assert sorted(manifest.files) == sorted([f"__{r}_0.distcp" for r in range(world)] + [".metadata"])
    assert all(len(manifest.files[f"__{r}_0.distcp"].items) == tensors for r in range(world))
    assert scale_cell.load_plan(storage, names, world - 1) == tensors
    _, again = scale_cell._second_save(world, names, results, cache)  # the plans reused
    assert again.files[".metadata"] == storage.files[".metadata"]


def test_cli_runs_the_grid_and_skips_cells_over_the_cap(capsys):
    assert cli.main(["bench", "scale", "--worlds", "2,4", "--tensors", "5,50", "--max-chunks", "100", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["world"], r["tensors"]) for r in rows] == [(2, 5), (2, 50), (4, 5), (4, 50)]
    assert "skipped" in rows[3] and "skipped" not in rows[2]
    measured = rows[:3]
    assert [r["chunks"] for r in measured] == [10, 100, 20]
    assert measured[1]["metadata_bytes"] > measured[0]["metadata_bytes"]
    assert measured[1]["manifest_bytes"] > measured[0]["manifest_bytes"]
    assert [r["rank_reads"] for r in measured] == [r["rank_reads_dcp"] for r in measured] == [5, 50, 5]
    assert all(r["second_over_first"] > 0 and r["bytes_per_chunk"] > 0 and r["open_us_per_chunk"] > 0 for r in measured)


def test_rows_read_back_into_a_table_and_a_plot(tmp_path, capsys):
    assert cli.main(["bench", "scale", "--worlds", "2,16", "--tensors", "4", "--json"]) == 0
    saved = tmp_path / "scale.jsonl"
    saved.write_text(capsys.readouterr().out)
    table = tmp_path / "scale.md"
    args = ["bench", "scale", "--from-json", str(saved), "--markdown", str(table)]
    try:
        import matplotlib  # noqa: F401  (the bench extra)

        args += ["--plot", str(tmp_path / "scale.png")]
    except ImportError:
        pass
    assert cli.main(args) == 0
    lines = table.read_text().splitlines()
    assert [line.split("|")[1:4] for line in lines[2:]] == [[" 2 ", " 4 ", " 8 "], [" 16 ", " 4 ", " 64 "]]
    if "--plot" in args:
        assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "method, path, query, expected",
    [
        ("GET", "/b", "list-type=2&prefix=run%2F", ("LIST", "listing")),
        ("GET", "/b", "list-type=2&max-keys=1&prefix=run%2F", ("LIST", "probe (max-keys=1)")),
        ("GET", "/b/run/ckpt/__3_0.distcp", "", ("GET", "shard")),
        ("HEAD", "/b/run/ckpt/.metadata", "", ("HEAD", ".metadata")),
        ("PUT", "/b/run/ckpt/ckptlib.json", "", ("PUT", "ckptlib.json")),
        ("POST", "/b/run/ckpt/__0_0.distcp", "uploads", ("multipart create", "shard")),
        ("PUT", "/b/run/ckpt/__0_0.distcp", "partNumber=2&uploadId=x", ("multipart part", "shard")),
        ("POST", "/b/run/ckpt/__0_0.distcp", "uploadId=x", ("multipart complete", "shard")),
        ("DELETE", "/b/run/ckpt/ckptlib.pending", "", ("DELETE", "ckptlib.pending")),
        ("POST", "/b", "delete", ("DELETE batch", "bucket")),
    ],
    ids=["list", "list-probe", "get", "head", "put", "mp-create", "mp-part", "mp-complete", "delete", "delete-batch"],
)
def test_s3_requests_are_classified(method, path, query, expected):
    assert s3_requests._classify({"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}) == expected


@pytest.mark.parametrize(
    "save_world, shard_mib, save_lists, puts, parts",
    [(4, 1, 2, 7, None), (4, 20, 2, 3, 8), (998, 1, 2, 1001, None), (999, 1, 3, 1002, None)],
    ids=["small-shards", "multipart", "one-list-page", "two-list-pages"],
)
def test_s3_formula(save_world, shard_mib, save_lists, puts, parts):
    counts = s3_requests.formula(save_world, save_world, shard_mib * s3_requests.MiB)
    assert counts["save"]["LIST"] == save_lists
    assert counts["save"]["PUT"] == puts
    assert counts["save"].get("multipart part") == parts
    assert counts["load"] == {"GET": 2 + save_world, "LIST": 2 + 2 * (save_lists - 1)}


def _known_collectives() -> dict:
    """Rank body: known collectives, a new group and a store round, counted."""
    import torch
    import torch.distributed as dist

    from ckptlib.bench import dist_counters, scale_ranks

    scale_ranks._recreate_group_on_counting_store(60.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    before = dist_counters.snapshot()
    objs = [{"payload": b"x" * 1000}] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    gathered = [None] * world
    dist.all_gather_object(gathered, ("rank", rank, b"y" * (100 * (rank + 1))))
    dist.all_reduce(torch.ones(10))  # float32: 40 bytes
    middle = dist_counters.snapshot()
    dist.new_group(backend="gloo")
    after = dist_counters.snapshot()
    return {
        "collectives": dist_counters.difference(before, middle),
        "group": dist_counters.difference(middle, after),
        "sizes": [len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in (objs[0], *gathered)],
    }


def test_counters_count_calls_payload_bytes_groups_and_store_operations():
    from ckptlib.testing import launch

    world = 3
    out = launch(world, _known_collectives, timeout=180)
    for rank, r in enumerate(out):
        assert r["collectives"]["by_collective"] == {
            "all_gather_object": 1,
            "all_reduce": 1,
            "broadcast_object_list": 1,
        }
        assert r["collectives"]["collectives"] == 3
        assert r["collectives"]["groups"] == 0 and r["collectives"]["store_ops"] == 0  # collectives: no store
        broadcast, gathered = r["sizes"][0], r["sizes"][1:]
        others = sum(gathered) - gathered[rank]
        if rank == 0:  # the root hands the object to each of the 2 other ranks
            assert r["collectives"]["sent"] == 2 * broadcast + gathered[0] + 40
            assert r["collectives"]["received"] == others + 40
        else:
            assert r["collectives"]["sent"] == gathered[rank] + 40
            assert r["collectives"]["received"] == broadcast + others + 40
        assert r["group"]["groups"] == 1 and r["group"]["collectives"] == 0
        # gloo's rendezvous of the new group, through the counting store: its address set, the peers' awaited and read
        assert {"set", "wait", "get"} <= set(r["group"]["by_store_op"])
        assert r["group"]["store_ops"] == sum(r["group"]["by_store_op"].values())
        assert r["group"]["sockets_added"] >= world - 1  # its connections to the other ranks
        assert r["group"]["sockets"] >= r["group"]["sockets_added"]


def test_real_ranks_count_every_operation_of_both_methods(capsys):
    """`--ranks 2` at a tiny state: every operation of both methods, every rank, loads bit-exact
    (the exit code), DCP's sync operations create no group and touch no store."""
    from ckptlib.bench import scale_ranks

    assert cli.main(["bench", "scale", "--ranks", "2", "--layers", "1", "--hidden", "16", "--json"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    result, fits = lines
    assert result["world"] == 2 and result["ok"] and result["tensors"] == 3 * 8 + 1
    assert [(r["op"], r["method"]) for r in result["rows"]] == [
        (op, method) for method in ("dcp", "ckptlib") for op in scale_ranks.OPS
    ]
    for row in result["rows"]:
        assert len(row["ranks"]) == 2
        for counts in row["ranks"]:
            assert counts["collectives"] == sum(counts["by_collective"].values()) > 0
            assert counts["store_ops"] == sum(counts["by_store_op"].values())
            assert counts["sockets"] > 0 and counts["threads"] >= 1
        if row["method"] == "dcp" and not row["op"].startswith("async"):
            assert all(c["groups"] == 0 and c["store_ops"] == 0 for c in row["ranks"])
        if row["op"].startswith("load"):
            assert row["ranks"][1]["received"] > 0  # the rank that is not the coordinator got its plan
    assert [(f["op"], f["method"]) for f in fits["growth"]] == [
        (op, method) for op in scale_ranks.OPS for method in ("ckptlib", "dcp")
    ]
    table = captured.err[captured.err.index("| ranks |") :].split("\n\n")[0].splitlines()
    assert len(table) == 2 + 12 and all(line.startswith("| 2 | ") for line in table[2:])


@pytest.mark.parametrize(
    "points, expected",
    [
        ([(2, 8), (4, 8), (8, 8)], 0.0),
        ([(2, 3), (4, 6), (16, 24)], 1.0),
        ([(2, 4), (4, 16), (8, 64)], 2.0),
        ([(2, 0), (8, 0)], 0.0),
        ([(2, 0), (4, 5), (8, 10)], 1.0),  # a zero is left out of the log fit
        ([(4, 7)], None),
    ],
    ids=["flat", "linear", "quadratic", "all-zero", "zero-left-out", "one-point"],
)
def test_growth_exponent(points, expected):
    from ckptlib.bench import scale_ranks

    assert scale_ranks.exponent(points) == expected


def test_load_plan_only_cells_read_one_chunk_per_tensor_both_ways(tmp_path, capsys):
    args = ["bench", "scale", "--load-plan-only", "--worlds", "4,16", "--tensors", "3", "--json"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["world"], r["chunks"], r["rank_reads"], r["rank_reads_dcp"]) for r in rows] == [
        (4, 12, 3, 3),
        (16, 48, 3, 3),
    ]
    assert all(r["process_peak_mib"] > 0 and "metadata_bytes" not in r for r in rows)
    saved = tmp_path / "plans.jsonl"
    saved.write_text(out)
    table = tmp_path / "plans.md"
    assert cli.main(["bench", "scale", "--from-json", str(saved), "--markdown", str(table)]) == 0
    lines = table.read_text().splitlines()
    assert lines[-2].startswith("| 4 | 3 | 12 | ") and lines[-1].startswith("| 16 | 3 | 48 | ")
