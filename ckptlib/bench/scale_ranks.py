"""`ckpt bench scale --ranks 2,4,8,16`: what a save, a load and an async save cost the process
group and the store per rank, at real gloo ranks, for ckptlib and plain DCP in the same run.

Each world size is two launches of ranks (`ckptlib.testing.launch`, gloo on CPU), one per
method, so that neither sees the other's groups, sockets or background threads (ckptlib first
at world sizes divisible by 4, DCP first otherwise). Every rank first re-creates its default
group on a `CountingStore` (a client of the launcher's TCP store, under a prefix of its own),
wraps the `torch.distributed` collectives and group makers (`ckptlib.bench.dist_counters`),
then builds a transformer-shaped state: `--layers` blocks (attention qkv and projection, MLP
up and down, two norms) of width `--hidden`, an embedding and a norm, and AdamW-like optimizer
state (exp_avg, exp_avg_sq and a step per parameter, param groups), every tensor a DTensor
`Shard(0)` over the ranks. Then, in order: a save, a second save of the same state (plans
reused), a load, a second load, an async save and a second one (each waited for), each save
into a fresh directory, the loads from the first. ckptlib: `ckptlib.save`, `ckptlib.load`,
`ckptlib.async_save(...).wait()`; DCP: `dcp.save`, `dcp.load` and
`dcp.async_save(...).result()` with its default file system writer and reader. Every load is
checked bit-exact against the saved values.

Around each operation (between two barriers that are not counted) every rank records the
difference of its counters: collective calls (by kind), payload bytes sent and received,
process groups created, store operations (by kind), and, after the operation, its open
sockets and Python threads (and how many the operation added). The table shows, per world
size, operation and method, the largest count over the ranks, rank 0's figures and rank 0's
wall seconds; `--json` keeps every rank's counts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from datetime import timedelta
from typing import Any

OPS = ("save", "save again", "load", "load again", "async save", "async save again")
METHODS = ("ckptlib", "dcp")
STORE_PREFIX = "ckptlib-bench-scale-ranks"


def _recreate_group_on_counting_store(timeout_s: float) -> None:
    import torch.distributed as dist

    from ckptlib.bench import dist_counters

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every peer is through the launcher's connectFullMesh before this rank leaves that group
    dist.destroy_process_group()
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=timeout_s)
    )
    store = dist_counters.CountingStore(dist.PrefixStore(STORE_PREFIX, client))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    dist_counters.install()


def make_state(layers: int, hidden: int, fill: bool) -> dict[str, Any]:
    """The model and its optimizer state, every tensor a DTensor Shard(0) over the world (rows
    are multiples of 16, so every world size up to 16 divides them)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = {"embed.weight": (16 * hidden, hidden), "norm.weight": (hidden,)}
    for layer in range(layers):
        p = f"layers.{layer}."
        shapes.update(
            {
                p + "attn.qkv.weight": (3 * hidden, hidden),
                p + "attn.proj.weight": (hidden, hidden),
                p + "mlp.up.weight": (4 * hidden, hidden),
                p + "mlp.down.weight": (hidden, 4 * hidden),
                p + "norm1.weight": (hidden,),
                p + "norm2.weight": (hidden,),
            }
        )

    def sharded(shape: tuple[int, ...], seed: int) -> Any:
        full = torch.zeros(shape)
        if fill:
            full.uniform_(generator=torch.Generator().manual_seed(seed))
        local = full.chunk(world)[rank].clone()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())

    model = {name: sharded(shape, i) for i, (name, shape) in enumerate(shapes.items())}
    optim_state = {
        name: {
            "step": torch.tensor(float(7 if fill else 0)),
            "exp_avg": sharded(shape, 10_000 + i),
            "exp_avg_sq": sharded(shape, 20_000 + i),
        }
        for i, (name, shape) in enumerate(shapes.items())
    }
    groups = [{"lr": 3e-4 if fill else 0.0, "betas": (0.9, 0.95), "params": list(shapes)}]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}}


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        left = a.to_local() if hasattr(a, "to_local") else a
        right = b.to_local() if hasattr(b, "to_local") else b
        return torch.equal(left, right)
    return a == b


def _operation(method: str, op: str, path: str, state: dict, template: dict) -> None:
    import torch.distributed.checkpoint as dcp

    import ckptlib

    if method == "ckptlib":
        if op.startswith("async save"):
            ckptlib.async_save(path, state).wait()
        elif op.startswith("save"):
            ckptlib.save(path, state)
        else:
            ckptlib.load(path, template)
    elif op.startswith("async save"):
        dcp.async_save(state, checkpoint_id=path).result()
    elif op.startswith("save"):
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(template, checkpoint_id=path)


def _zero(template: dict) -> None:
    import torch

    with torch.no_grad():
        for block in (template["model"], *template["optim"]["state"].values()):
            for value in block.values():
                (value.to_local() if hasattr(value, "to_local") else value).zero_()


def rank_scale(root: str, layers: int, hidden: int, order: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    """One rank of a launch: every method's operations, counted (see the module's docstring)."""
    import torch.distributed as dist

    from ckptlib.bench import dist_counters

    _recreate_group_on_counting_store(timeout_s)
    barrier = dist_counters.original("barrier")
    rank = dist.get_rank()
    state = make_state(layers, hidden, fill=True)
    template = make_state(layers, hidden, fill=False)
    rows: list[dict[str, Any]] = []
    ok = True
    for method in order:
        for op in OPS:
            name = "save" if op.startswith("load") else op.replace(" ", "-")  # the loads read the first save
            path = os.path.join(root, f"{method}-{name}")
            if op.startswith("load"):
                _zero(template)
            barrier()
            before = dist_counters.snapshot()
            started = time.perf_counter()
            _operation(method, op, path, state, template)
            seconds = time.perf_counter() - started
            after = dist_counters.snapshot()
            barrier()
            if op.startswith("load"):
                ok = ok and _same(state, template)
            rows.append({"method": method, "op": op, "seconds": seconds, **dist_counters.difference(before, after)})
    barrier()
    return {"rank": rank, "ok": ok, "rows": rows}


def measure(world: int, layers: int, hidden: int, timeout_s: float, directory: str | None = None) -> dict[str, Any]:
    """A launch of `world` ranks per method: {"world", "ok", "tensors", "rows": [per (method,
    op): every rank's counts]}."""
    from ckptlib.testing import launch

    rows, ok = [], True
    for method in METHODS if world % 4 == 0 else METHODS[::-1]:
        root = tempfile.mkdtemp(prefix="ckptlib-bench-scale-ranks-", dir=directory)
        try:
            out = launch(world, rank_scale, root, layers, hidden, (method,), timeout_s, timeout=timeout_s)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        ok = ok and all(r["ok"] for r in out)
        for i, first in enumerate(out[0]["rows"]):
            rows.append({"method": first["method"], "op": first["op"], "ranks": [r["rows"][i] for r in out]})
    tensors = 2 + 6 * layers
    return {"world": world, "ok": ok, "tensors": 3 * tensors + 1, "rows": rows}


COLUMNS = (  # (header, key, how the ranks' values are combined)
    ("collectives", "collectives", "max"),
    ("rank 0 sent KB", "sent", "rank0"),
    ("rank 0 received KB", "received", "rank0"),
    ("max received KB (others)", "received", "others"),
    ("groups created", "groups", "max"),
    ("store ops: rank 0 / max / all ranks", "store_ops", "store"),
    ("sockets after (added)", "sockets", "sockets"),
    ("threads after (added)", "threads", "threads"),
    ("rank 0 s", "seconds", "rank0"),
)


def cell(ranks: list[dict[str, Any]], key: str, how: str) -> str:
    """One table cell from every rank's counts."""
    values = [r[key] for r in ranks]
    if how == "max":
        return str(max(values))
    if how == "store":
        return f"{values[0]} / {max(values)} / {sum(values)}"
    if how in ("sockets", "threads"):
        added = max(r[f"{key}_added"] for r in ranks)
        return f"{max(values)} ({added:+d})"
    value = values[0] if how == "rank0" else max(values[1:], default=0)
    if key == "seconds":
        return f"{value:.3f}"
    return f"{value / 1000:.1f}"


def markdown(results: list[dict[str, Any]]) -> str:
    """Every launch's operations as one table (the largest count over the ranks unless named)."""
    lines = [
        "| ranks | operation | method | " + " | ".join(header for header, _, _ in COLUMNS) + " |",
        "|---:|---|---|" + "---:|" * len(COLUMNS),
    ]
    for result in results:
        by = {(r["op"], r["method"]): r for r in result["rows"]}
        for op in OPS:
            for method in METHODS:
                row = by.get((op, method))
                if row is None:
                    continue
                cells = " | ".join(cell(row["ranks"], key, how) for _, key, how in COLUMNS)
                lines.append(f"| {result['world']} | {op} | {method} | {cells} |")
    return "\n".join(lines)


GROWTH = (  # (figure, key, which ranks): the figures `growth` fits
    ("collectives", "collectives", "max"),
    ("rank 0 sent", "sent", "rank0"),
    ("rank 0 received", "received", "rank0"),
    ("others received", "received", "others"),
    ("store ops", "store_ops", "max"),
    ("sockets", "sockets", "max"),
)


def _figure(ranks: list[dict[str, Any]], key: str, which: str) -> float:
    values = [r[key] for r in ranks]
    if which == "rank0":
        return values[0]
    return max(values[1:] if which == "others" else values, default=0)


def exponent(points: list[tuple[int, float]]) -> float | None:
    """b of the least-squares fit y = a * n**b over (n, y) with y > 0 (None: fewer than two;
    0.0 when every y is 0: flat)."""
    import math

    usable = [(n, y) for n, y in points if y > 0]
    if not usable and points:
        return 0.0
    if len({n for n, _ in usable}) < 2:
        return None
    xs = [math.log(n) for n, _ in usable]
    ys = [math.log(y) for _, y in usable]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 2)


def growth(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (operation, method) and figure (`GROWTH`), the exponent b of a least-squares fit
    figure = a * ranks**b over the world sizes measured (0: flat; 1: linear in the ranks;
    None: fewer than two world sizes), and the figure at the largest world size."""
    fits = []
    keys = sorted(
        {(r["op"], r["method"]) for result in results for r in result["rows"]}, key=lambda k: (OPS.index(k[0]), k[1])
    )
    for op, method in keys:
        entry: dict[str, Any] = {"op": op, "method": method}
        for figure, key, which in GROWTH:
            points = [
                (result["world"], _figure(row["ranks"], key, which))
                for result in results
                for row in result["rows"]
                if (row["op"], row["method"]) == (op, method)
            ]
            entry[figure] = exponent(points)
            entry[f"{figure} at {max(n for n, _ in points)}"] = max(points)[1]
        fits.append(entry)
    return fits


__all__ = ["OPS", "exponent", "growth", "make_state", "markdown", "measure", "rank_scale"]
