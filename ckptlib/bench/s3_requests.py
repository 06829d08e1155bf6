"""S3 requests of a `ckptlib.save` and a `ckptlib.load`, counted on a moto server, and the
formula that predicts them for any world size (issue 13; docs/history/benchmarks-results.md, "Simulated scale").

A WSGI middleware in front of moto's app classifies every request the ranks send (LIST,
HEAD, GET, PUT, multipart create/part/complete, DELETE, ...) and the object it names (shard
file, `.metadata`, manifest, pending marker). Each save and each load runs in its own
`ckptlib.testing.launch`, so the counts of one phase are exactly that phase's requests.

    python -m ckptlib.bench.s3_requests         # measured at 1, 2, 4 ranks next to `formula`, then
                                                # the formula at 8..4,096 ranks
    ckpt bench scale --s3                       # the same, after the planning grid
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import urllib.parse
from typing import Any, Iterator

MiB = 1 << 20
COLS = 256  # float32 columns of every tensor: 1 KiB a row
SCENARIOS = (  # (name, tensors, MiB per rank's shard): below and above the 16 MiB multipart threshold
    ("16 small tensors", 16, 1),
    ("4 large tensors", 4, 20),
)


def _classify(environ: dict[str, Any]) -> tuple[str, str]:
    """(request kind, object kind) of one request to a path-style S3 endpoint."""
    method = environ["REQUEST_METHOD"]
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    bucket, _, key = environ.get("PATH_INFO", "").lstrip("/").partition("/")
    name = key.rsplit("/", 1)[-1]
    obj = ("shard" if name.endswith(".distcp") else name) if key else "bucket"
    if method == "GET" and not key and "uploads" not in query:
        obj = "probe (max-keys=1)" if query.get("max-keys") == ["1"] else "listing"
    if method == "GET":
        kind = "LIST uploads" if "uploads" in query else ("LIST" if not key else "GET")
    elif method == "HEAD":
        kind = "HEAD"
    elif method == "PUT":
        kind = "multipart part" if "partNumber" in query else "PUT"
    elif method == "POST":
        kind = {"uploads": "multipart create", "uploadId": "multipart complete", "delete": "DELETE batch"}.get(
            next((q for q in ("uploads", "uploadId", "delete") if q in query), ""), "POST"
        )
    elif method == "DELETE":
        kind = "multipart abort" if "uploadId" in query else "DELETE"
    else:
        kind = method
    return kind, obj


class _Counter:
    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()

    def __call__(self, environ, start_response):
        with self.lock:
            self.counts[_classify(environ)] += 1
        return self.app(environ, start_response)

    def take(self) -> collections.Counter:
        with self.lock:
            counts, self.counts = self.counts, collections.Counter()
        return counts


@contextlib.contextmanager
def counting_moto_server() -> Iterator[tuple[str, _Counter]]:
    """A moto S3 server on 127.0.0.1 behind a request counter: yields (endpoint, counter)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    counter = _Counter(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counter
    finally:
        server.shutdown()
        thread.join()


def _state(tensors: int, global_rows: int, fill: bool) -> dict[str, Any]:
    """`tensors` DTensors of (global_rows, COLS) float32, row-sharded; rank r's rows of tensor i
    hold 1000 * i + r when `fill` (zeros otherwise)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = global_rows // world
    params = {}
    for i in range(tensors):
        local = torch.full((rows, COLS), float(1000 * i + rank) if fill else 0.0)
        params[f"t{i}"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(global_rows, COLS), stride=(COLS, 1)
        )
    return {"params": params}


def rank_phase(env: dict[str, str], uri: str, phase: str, tensors: int, global_rows: int, save_world: int) -> bool:
    """In each rank: the save, or the load (then a check of every tensor's sum against the save's)."""

    import ckptlib

    os.environ.update(env)
    if phase == "save":
        ckptlib.save(uri, _state(tensors, global_rows, fill=True))
        return True
    template = _state(tensors, global_rows, fill=False)
    ckptlib.load(uri, template)
    rows_saved = global_rows // save_world
    return all(
        float(template["params"][f"t{i}"].full_tensor().double().sum())
        == COLS * rows_saved * sum(1000 * i + r for r in range(save_world))
        for i in range(tensors)
    )


def measure(pairs=((1, 1), (2, 2), (4, 4), (4, 2), (2, 4)), scenarios=SCENARIOS, timeout: float = 300) -> list[dict]:
    """Counted requests of each (save world N, load world M) and scenario."""
    from ckptlib.testing import launch
    from ckptlib.testing.fakes.s3_server import create_bucket, s3_env

    rows = []
    with counting_moto_server() as (endpoint, counter):
        env = {k: v for k, v in s3_env(endpoint).items() if v is not None}
        os.environ.update(env)
        for name, tensors, shard_mib in scenarios:
            for save_world, load_world in pairs:
                bucket = create_bucket(endpoint, "reqs")
                uri = f"s3://{bucket}/run/ckpt"
                global_rows = shard_mib * MiB // (tensors * COLS * 4) * save_world
                args = (env, uri, "save", tensors, global_rows, save_world)
                counter.take()
                launch(save_world, rank_phase, *args, timeout=timeout)
                saved = counter.take()
                ok = launch(load_world, rank_phase, *args[:2], "load", *args[3:], timeout=timeout)
                loaded = counter.take()
                rows.append(
                    {
                        "scenario": name,
                        "tensors": tensors,
                        "shard_mib": shard_mib,
                        "save_world": save_world,
                        "load_world": load_world,
                        "ok": all(ok),
                        "save": {f"{k} {o}": n for (k, o), n in sorted(saved.items())},
                        "load": {f"{k} {o}": n for (k, o), n in sorted(loaded.items())},
                    }
                )
    return rows


KINDS = (
    "LIST uploads",
    "LIST",
    "HEAD",
    "GET",
    "PUT",
    "multipart create",
    "multipart part",
    "multipart complete",
    "multipart abort",
    "DELETE batch",
    "DELETE",
    "POST",
)


def _totals(counts: dict[str, int]) -> dict[str, int]:
    """{"KIND object": n} summed per request kind."""
    out: collections.Counter = collections.Counter()
    for key, n in counts.items():
        out[next((k for k in KINDS if key.startswith(k + " ")), key)] += n
    return dict(sorted(out.items()))


def formula(
    save_world: int,
    load_world: int,
    shard_bytes: int,
    *,
    threshold: int = 16 * MiB,
    part: int = 16 * MiB,
    page: int = 1000,
) -> dict[str, dict[str, int]]:
    """Requests of one ckptlib.save at `save_world` ranks (each writing `shard_bytes`) and one
    ckptlib.load of it at `load_world` ranks, when every rank reads whole stored items (same
    world size, or small items). Loads that need part of a large stored item instead fetch its
    zip directory, its record header and the needed 1 MiB checksum blocks (ranged GETs)."""
    pages = -(-(save_world + 2) // page)  # LIST pages of the checkpoint's files (shards + 2)
    multipart = shard_bytes >= threshold
    parts = -(-shard_bytes // part)
    save = {"LIST": 1 + pages, "PUT": 3 + (0 if multipart else save_world), "DELETE": 1}
    if multipart:
        save.update(
            {"multipart create": save_world, "multipart part": save_world * parts, "multipart complete": save_world}
        )
    load = {"LIST": 2 + 2 * pages, "GET": 2 + max(save_world, load_world)}
    return {"save": dict(sorted(save.items())), "load": dict(sorted(load.items()))}


def rows(worlds: list[int]) -> list[dict]:
    """Measured rows (1, 2, 4 ranks) with the formula's prediction beside them, then the
    formula alone for every world size of the grid (20 MiB shards)."""
    out = []
    for row in measure():
        shard_bytes = row["shard_mib"] * MiB
        out.append(
            {
                "s3": "measured",
                **{k: row[k] for k in ("scenario", "save_world", "load_world", "ok")},
                "save": _totals(row["save"]),
                "load": _totals(row["load"]),
                "formula": formula(row["save_world"], row["load_world"], shard_bytes),
                "save_by_object": row["save"],
                "load_by_object": row["load"],
            }
        )
    for world in worlds:
        out.append(
            {
                "s3": "formula",
                "save_world": world,
                "load_world": world,
                "shard_mib": 20,
                **formula(world, world, 20 * MiB),
            }
        )
    return out


if __name__ == "__main__":
    import json

    for row in rows([8, 64, 512, 4096]):
        print(json.dumps(row))
