"""`ckpt validate`: the save-at-N / load-at-M round trip on the user's storage and cluster.

With `--layouts` the pairs are (layout A at N, layout B at M) of a small transformer
(`layout_matrix`); with `--spec` of the user's own training job (`spec_matrix`, a
`training_spec.TrainingSpec`); 2-D layouts on a subgroup use meshes made from
`layouts.mesh_groups`. A failure inside the spec's own functions is not a failing pair but a
`training_spec.SpecError` (rank and traceback) raised out of the run on the ranks that hit it.

One process group of max(world sizes) ranks runs every pair: for each N the first N ranks
form a subgroup that trains and saves; for each M the first M ranks load, compare
bit-exactly and train one more step against a never-checkpointed reference. Under torchrun
the same function runs on the real ranks; locally the launcher starts them.

Saves and loads go through a checkpointer (``ckptlib.testing.checkpointers``: `--checkpointer
module:attr`; default ckptlib's ``CheckpointManager``, `ckptlib_adapter.CkptlibCheckpointer`).
Entries it does not carry are not compared and are listed per cell (``not_carried``). A failing
cell's error starts with the first difference and the rank that saw it ("rank R: KEY: ..."):
see `matrix.KINDS` for the order.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
import uuid
from typing import Any

import torch.distributed as dist

from ckptlib.testing.matrices import layout_matrix, matrix
from ckptlib.testing.matrices import parallel_layouts as layouts_mod
from ckptlib.testing.matrices.training_spec import SpecError


@dataclasses.dataclass
class Cell:
    save_ws: int
    load_ws: int
    ok: bool
    seconds: float
    error: str = ""
    save_layout: str = ""  # set by --layouts runs (else the report's `wrap` on both sides)
    load_layout: str = ""
    not_carried: list[str] = dataclasses.field(default_factory=list)  # state entries not compared

    @property
    def id(self) -> str:
        if self.save_layout:
            return f"save{self.save_ws}-{self.save_layout}-load{self.load_ws}-{self.load_layout}"
        return f"save{self.save_ws}-load{self.load_ws}"


@dataclasses.dataclass
class Report:
    root: str
    wrap: str
    optim: str
    world_sizes: list[int]
    cells: list[Cell]
    layouts: list[str] | None = None
    spec: str | None = None  # the --spec reference of a run on the user's training job
    checkpointer: str = "ckptlib"  # what saved and loaded: the --checkpointer reference, or its name

    @property
    def ok(self) -> bool:
        return bool(self.cells) and all(c.ok for c in self.cells)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "root": self.root,
            "wrap": self.wrap,
            "optim": self.optim,
            "world_sizes": self.world_sizes,
            "layouts": self.layouts,
            "spec": self.spec,
            "checkpointer": self.checkpointer,
            "cells": [dataclasses.asdict(c) for c in self.cells],
        }

    def table(self) -> str:
        """Rows: saved at N; columns: loaded at M; each cell pass/FAIL and seconds.
        With layouts: rows and columns are `layout@N`."""
        if self.layouts:
            return self._layout_table()
        by = {(c.save_ws, c.load_ws): c for c in self.cells}
        width = 14
        head = "save\\load".ljust(10) + "".join(f"M={m}".ljust(width) for m in self.world_sizes)
        lines = [head]
        for n in self.world_sizes:
            row = f"N={n}".ljust(10)
            for m in self.world_sizes:
                cell = by.get((n, m))
                text = "-" if cell is None else f"{'pass' if cell.ok else 'FAIL'} {cell.seconds:.2f}s"
                row += text.ljust(width)
            lines.append(row)
        failures = [c for c in self.cells if not c.ok]
        for c in failures:
            lines.append(f"{c.id}: {c.error}")
        return "\n".join(lines + self._not_carried())

    def _not_carried(self) -> list[str]:
        names = sorted({name for c in self.cells for name in c.not_carried})
        if not names:
            return []
        return [f"not carried by {self.checkpointer} (not compared): {', '.join(names)}"]

    def _layout_table(self) -> str:
        saves = list(dict.fromkeys((c.save_layout, c.save_ws) for c in self.cells))
        loads = list(dict.fromkeys((c.load_layout, c.load_ws) for c in self.cells))
        by = {(c.save_layout, c.save_ws, c.load_layout, c.load_ws): c for c in self.cells}
        width = max([11] + [len(f"{name}@{n}") + 2 for name, n in loads])
        first = max([12] + [len(f"{name}@{n}") + 2 for name, n in saves])
        lines = ["save\\load".ljust(first) + "".join(f"{name}@{n}".ljust(width) for name, n in loads)]
        for name, n in saves:
            row = f"{name}@{n}".ljust(first)
            for other, m in loads:
                cell = by.get((name, n, other, m))
                text = "-" if cell is None else f"{'pass' if cell.ok else 'FAIL'} {cell.seconds:.1f}s"
                row += text.ljust(width)
            lines.append(row)
        lines += [f"{c.id}: {c.error}" for c in self.cells if not c.ok]
        return "\n".join(lines + self._not_carried())


def _subgroups(world_sizes: list[int]) -> dict[int, Any]:
    """One subgroup per world size, made by every rank in the same order (a collective)."""
    world = dist.get_world_size()
    return {n: (None if n == world else dist.new_group(ranks=list(range(n)))) for n in world_sizes}


def _fail_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1][:500]


def _check_sizes(world_sizes: list[int]) -> None:
    world = dist.get_world_size()
    too_big = [n for n in world_sizes if n > world]
    if too_big:
        raise ValueError(f"world sizes {too_big} exceed the {world} ranks available")


def _start(root: str, total: int, desc: str, progress: bool) -> tuple[str, Any]:
    """The run's directory (one name, broadcast from rank 0) and rank 0's progress bar of
    `total` steps (None elsewhere or without `progress`)."""
    box = [uuid.uuid4().hex[:8] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    bar = None
    if progress and dist.get_rank() == 0:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="step")
    return f"{root.rstrip('/')}/ckpt-validate-{box[0]}", bar


def _gather_problems(problems: list[str], m: int) -> tuple[list[str], list[str]]:
    """(every problem the first `m` ranks found loading one cell, each as "rank R: ...", the
    first difference first: see `matrix.KINDS`; a problem seen alike on several ranks once,
    under the first; the state entries not carried) (a collective over all ranks)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (list(problems), list(getattr(problems, "not_carried", ()))))
    seen: dict[str, tuple[int, int, int]] = {}
    for rank, (found, _) in enumerate(gathered[:m]):
        for i, text in enumerate(found):
            seen.setdefault(text, (matrix.problem_kind(text), rank, i))
    ordered = sorted(seen, key=seen.__getitem__)
    not_carried = gathered[0][1] if m and gathered[0] else []
    return [f"rank {seen[text][1]}: {text}" for text in ordered], not_carried


def _first_error(error: str | None) -> list[Any]:
    """[the first failing rank's save error, or None] on every rank (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return [next((text for text in gathered if text), None)]


def _checkpointer(ref: Any) -> tuple[Any, str]:
    """(the checkpointer `ref` names, its label): ckptlib's manager when `ref` is None."""
    from ckptlib.testing.checkpointers import ckptlib_adapter, protocol

    if ref is None:
        return ckptlib_adapter.CkptlibCheckpointer(), "ckptlib"
    cp = protocol.resolve(ref)
    return cp, ref if isinstance(ref, str) else protocol.describe(cp)


def _finish(base: str, bar: Any) -> None:
    """Close the bar and remove the run's checkpoints (rank 0), all ranks together."""
    if bar:
        bar.close()
    if dist.get_rank() == 0:
        _cleanup(base)
    dist.barrier()


def run_pairs(
    root: str, world_sizes: list[int], wrap: str, optim: str, progress: bool = True, checkpointer: Any = None
) -> Report | None:
    """Run every (N, M) pair inside an initialized process group, saving and loading through
    `checkpointer` (a checkpointers.resolve reference; default ckptlib's manager); the report
    on rank 0."""
    rank = dist.get_rank()
    _check_sizes(world_sizes)
    cp, label = _checkpointer(checkpointer)
    groups = _subgroups(world_sizes)
    base, bar = _start(root, len(world_sizes) * (1 + len(world_sizes)), "ckpt validate", progress)
    cells: list[Cell] = []
    for n in world_sizes:
        uri = f"{base}/save{n}"
        expected: list[Any] = [None]
        error = None
        if rank < n:
            try:
                expected[0] = matrix.save_side(uri, wrap, optim, group=groups[n], checkpointer=cp)
            except Exception as exc:  # recorded in every cell of this row
                error = f"save at {n} ranks failed: {_fail_text(exc)}"
        dist.broadcast_object_list(expected, src=0)
        save_error = _first_error(error)
        if bar:
            bar.update(1)
        for m in world_sizes:
            start = time.perf_counter()
            problems: list[str] = []
            if save_error[0]:
                problems = [save_error[0]]
            elif rank < m:
                try:
                    problems = matrix.load_side(uri, wrap, optim, expected[0], group=groups[m], checkpointer=cp)
                except Exception as exc:
                    problems = [f"load at {m} ranks failed: {_fail_text(exc)}"]
            merged, skipped = _gather_problems(problems, m)
            seconds = time.perf_counter() - start
            cells.append(Cell(n, m, not merged, seconds, "; ".join(merged[:3]), not_carried=skipped))
            if bar:
                bar.update(1)
        dist.barrier()
    _finish(base, bar)
    return Report(root, wrap, optim, list(world_sizes), cells, checkpointer=label) if rank == 0 else None


def layouts_fit(layouts: list[str], world_sizes: list[int]) -> bool:
    """Whether some layout of `layouts` runs at some size of `world_sizes`."""
    return any(layouts_mod.get_layout(name).supports(n) for name in layouts for n in world_sizes)


def run_layout_pairs(
    root: str,
    world_sizes: list[int],
    layouts: list[str],
    optim: str,
    *,
    pairs: str = "all",
    progress: bool = True,
    spec: Any = None,
    checkpointer: Any = None,
) -> Report | None:
    """Every (layout A at N) save loaded at every (layout B at M) inside an initialized
    process group (`pairs="covering"`: one case per layout pair); the report on rank 0.
    `spec`: a `training_spec.load_spec` reference or a spec object; its job is trained
    instead of the small transformer (and `optim` is not used). `checkpointer`: as `run_pairs`."""
    rank = dist.get_rank()
    _check_sizes(world_sizes)
    select = layout_matrix.covering_subset if pairs == "covering" else layout_matrix.full_product
    cases = select(layouts, world_sizes, optim)
    if not cases:
        raise ValueError(f"no world size in {world_sizes} suits the layouts {layouts} (2-D layouts need 4, 6, ...)")
    cp, cp_label = _checkpointer(checkpointer)
    save, load, label = _sides(spec, optim, cp)
    groups = _subgroups(world_sizes)
    groups_2d = layouts_mod.mesh_groups(world_sizes, layouts)
    saves = list(dict.fromkeys((c.save_layout, c.save_ws) for c in cases))
    title = "ckpt validate --spec" if spec else "ckpt validate --layouts"
    base, bar = _start(root, len(saves) + len(cases), title, progress)
    cells: list[Cell] = []
    for layout, n in saves:
        uri = f"{base}/save{n}-{layout}"
        box, error = [None], None  # expected state, save error
        if rank < n:
            try:
                box[0] = save(uri, layout, group=groups[n], groups_2d=groups_2d.get((layout, n)))
            except SpecError:
                raise  # the user's code failed: not a finding about checkpoints (see the module docstring)
            except Exception as exc:
                error = f"save at {layout} on {n} ranks failed: {_fail_text(exc)}"
        dist.broadcast_object_list(box, src=0)
        box += _first_error(error)
        if bar:
            bar.update(1)
        for case in (c for c in cases if (c.save_layout, c.save_ws) == (layout, n)):
            m, target = case.load_ws, case.load_layout
            start = time.perf_counter()
            problems: list[str] = [box[1]] if box[1] else []
            if not box[1] and rank < m:
                try:
                    problems = load(uri, target, box[0], group=groups[m], groups_2d=groups_2d.get((target, m)))
                except SpecError:
                    raise
                except Exception as exc:
                    problems = [f"load at {target} on {m} ranks failed: {_fail_text(exc)}"]
            merged, skipped = _gather_problems(problems, m)
            seconds = time.perf_counter() - start
            cells.append(Cell(n, m, not merged, seconds, "; ".join(merged[:3]), layout, target, skipped))
            if bar:
                bar.update(1)
        dist.barrier()
    _finish(base, bar)
    if rank != 0:
        return None
    return Report(
        root,
        "spec" if spec else "layouts",
        "" if spec else optim,
        list(world_sizes),
        cells,
        list(layouts),
        label,
        cp_label,
    )


def _sides(spec: Any, optim: str, cp: Any):
    """(save(uri, layout, group=, groups_2d=) -> expected, load(uri, layout, expected, group=,
    groups_2d=) -> problems, the spec's label) of the small transformer, or of the spec's job
    (a reference string or a spec object), through the checkpointer `cp`."""
    if spec is None:
        return (
            lambda uri, layout, **kw: layout_matrix.save_layout(uri, layout, optim, checkpointer=cp, **kw),
            lambda uri, layout, expected, **kw: layout_matrix.load_layout(
                uri, layout, expected, optim, checkpointer=cp, **kw
            ),
            None,
        )
    from ckptlib.testing.matrices import spec_matrix
    from ckptlib.testing.matrices.training_spec import as_training_spec, load_spec

    job = load_spec(spec) if isinstance(spec, str) else as_training_spec(spec)
    return (
        lambda uri, layout, **kw: spec_matrix.save_spec(uri, job, layout, checkpointer=cp, **kw),
        lambda uri, layout, expected, **kw: spec_matrix.load_spec_layout(
            uri, job, layout, expected, checkpointer=cp, **kw
        ),
        spec if isinstance(spec, str) else job.label,
    )


def _cleanup(base: str) -> None:
    """Remove the run's checkpoints; a failure here must not hide the report."""
    from ckptlib.errors import CheckpointError
    from ckptlib.storage import open_storage

    try:
        open_storage(base).delete_tree()
    except (CheckpointError, OSError) as exc:
        print(f"ckpt validate: could not remove {base}: {exc}", file=sys.stderr)


def default_wrap() -> str:
    from ckptlib._torch import parallel

    return "fsdp2" if parallel.fsdp2_cpu_reason() is None else "ddp"


def rank_entry(
    root: str,
    world_sizes: list[int],
    wrap: str,
    optim: str,
    progress: bool,
    layouts: list[str] | None = None,
    pairs: str = "all",
    spec: Any = None,
    checkpointer: Any = None,
) -> dict | None:
    """Entry point for launcher ranks (module-level so it pickles by reference)."""
    if layouts:
        report = run_layout_pairs(
            root, world_sizes, layouts, optim, pairs=pairs, progress=progress, spec=spec, checkpointer=checkpointer
        )
    else:
        report = run_pairs(root, world_sizes, wrap, optim, progress, checkpointer)
    return None if report is None else report.to_json()


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def report_from_json(doc: dict) -> Report:
    cells = [Cell(**c) for c in doc["cells"]]
    return Report(
        doc["root"],
        doc["wrap"],
        doc["optim"],
        doc["world_sizes"],
        cells,
        doc.get("layouts"),
        doc.get("spec"),
        doc.get("checkpointer", "ckptlib"),
    )


def dumps(report: Report) -> str:
    return json.dumps(report.to_json(), indent=1)
