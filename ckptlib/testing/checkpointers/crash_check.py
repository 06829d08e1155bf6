"""The crash harness for any checkpointer: `crash_check(checkpointer, world_size=2)`.

1. Record: on `world_size` fresh ranks the checkpointer saves step 1, then step 2 under the
   probe (`crash_probe`), which records every write boundary each rank crosses below the root;
   files that changed below the root without a boundary naming them are reported as unseen
   (written below Python, where no interposition reaches). The checkpointer's own load must
   then resume step 2 bit-exactly (the undisturbed baseline).
2. For each boundary (rank r, index i), or a bounded sample of them (`max_points`), and each
   victims mode: on a fresh root the same two saves run again and the save of step 2 is
   SIGKILLed at that boundary, in rank r alone ("one": the other ranks carry on until they fail
   or finish) or in every rank at that moment ("all": rank r kills its peers, then itself).
3. Then the checkpointer's load runs in a fresh process group of `world_size` ranks. It must
   resume step 1 bit-exactly, or step 2 bit-exactly (its save got far enough), or raise. Any
   other outcome is a violation: a half-written step (the step it names, not that step's state),
   the wrong step, no step at all (step 1, committed before the crash, lost), ranks resuming
   different steps, a load that hangs or crashes.

Every violation comes with the calls each rank made up to the kill and a ready-to-run
reproduction. A raise is no violation, but it is counted (`CrashReport.raised`): such a run
cannot resume until someone clears the half-written step by hand.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import uuid
from typing import Any, Iterable

from ckptlib.testing.checkpointers.crash_probe import Boundary, read_trace, unseen
from ckptlib.testing.checkpointers.crash_ranks import COMMITTED, KILLED, rank_load, rank_save
from ckptlib.testing.checkpointers.protocol import CheckpointerError, resolve

VICTIMS = ("one", "all")
#: What every rank of every case imports: into the forkserver once, where it has not started
#: yet (torch._dynamo is the first optimizer's import, seconds on a busy machine).
PRELOAD = ("torch._dynamo", "ckptlib.testing.matrices.matrix", "ckptlib.testing.checkpointers.crash_ranks")


@dataclasses.dataclass
class CrashCase:
    """One kill: at `boundary` (the recording run's), victims "one" or "all"; what the load did
    (`outcome`), why that is a violation (`problem`, "" when it is none), the calls each rank
    made before the kill (`calls`: rank -> boundaries, the victim's last is where it died)."""

    boundary: Boundary
    victims: str
    outcome: str
    detail: str = ""
    problem: str = ""
    calls: dict[int, list[Boundary]] = dataclasses.field(default_factory=dict)
    reproduction: str = ""

    @property
    def label(self) -> str:
        b = self.boundary
        where = f"#{b.index} {b.kind} {b.path}"
        if self.victims == "one":
            return f"rank {b.rank} killed at {where}"
        return f"every rank killed when rank {b.rank} reached {where}"

    @property
    def message(self) -> str:
        return f"{self.label}: {self.problem}"

    def sequence(self) -> str:
        lines = []
        for rank, calls in sorted(self.calls.items()):
            lines.append(f"  rank {rank}: " + ("; ".join(f"#{b.index} {b.kind} {b.path}" for b in calls) or "(none)"))
        return "\n".join(lines)


@dataclasses.dataclass
class CrashReport:
    """What `crash_check` found: every rank's boundaries, the unseen writes, the baseline
    (the undisturbed save's load) and each case."""

    checkpointer: str
    world_size: int
    boundaries: dict[int, list[Boundary]]
    unseen: list[str]
    baseline: str
    cases: list[CrashCase]
    skipped: int = 0  # boundaries left out by max_points

    @property
    def violations(self) -> list[CrashCase]:
        return [case for case in self.cases if case.problem]

    @property
    def raised(self) -> list[CrashCase]:
        return [case for case in self.cases if case.outcome == "raised"]

    @property
    def ok(self) -> bool:
        return not self.baseline and not self.violations

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (`ckpt validate --crash --json`)."""
        return {
            "ok": self.ok,
            **dataclasses.asdict(self),
            "boundaries": {str(rank): [dataclasses.asdict(b) for b in bs] for rank, bs in self.boundaries.items()},
            "cases": [
                {
                    "point": case.boundary.point,
                    "label": case.label,
                    "victims": case.victims,
                    "outcome": case.outcome,
                    "detail": case.detail,
                    "problem": case.problem,
                    "reproduction": case.reproduction,
                }
                for case in self.cases
            ],
        }

    def text(self) -> str:
        total = sum(len(b) for b in self.boundaries.values())
        lines = [f"crash check of {self.checkpointer} on {self.world_size} ranks: {total} write boundaries"]
        for rank, boundaries in sorted(self.boundaries.items()):
            lines.append(f"rank {rank}: " + "; ".join(f"#{b.index} {b.kind} {b.path}" for b in boundaries))
        if self.unseen:
            lines.append("unseen (written below Python, no boundary names them): " + "; ".join(self.unseen))
        if self.baseline:
            lines.append(f"BASELINE FAILED (no crash at all): {self.baseline}")
        counts: dict[str, int] = {}
        for case in self.cases:
            counts[case.outcome] = counts.get(case.outcome, 0) + 1
        shown = ", ".join(f"{outcome} {n}" for outcome, n in sorted(counts.items()))
        skipped = f" ({self.skipped} boundaries not sampled)" if self.skipped else ""
        lines.append(f"{len(self.cases)} kill cases{skipped}: {shown or 'none'}")
        if self.raised:
            lines.append(
                f"{len(self.raised)} cases raised on load: no violation, but that run cannot resume until the "
                f"half-written step is removed by hand (first: {self.raised[0].label}: {self.raised[0].detail})"
            )
        for case in self.violations:
            lines += [f"VIOLATION {case.message}", "each rank's calls (the victim's last is where it died):"]
            lines += [case.sequence(), case.reproduction]
        lines.append("crash consistent" if self.ok else "NOT CRASH CONSISTENT")
        return "\n".join(lines)


def _ref_text(ref: Any) -> str:
    """How a reproduction names the checkpointer: its `module:attr` reference."""
    if isinstance(ref, str):
        return ref
    target = ref if isinstance(ref, type) or callable(ref) and not hasattr(ref, "save") else type(ref)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"


def _reproduction(run: "_Run", ref: Any, point: str, victims: str) -> str:
    root = f", root={run.root!r}" if run.root else ""
    return (
        "reproduce:\n"
        "  from ckptlib.testing import crash_check\n"
        f"  print(crash_check({_ref_text(ref)!r}, world_size={run.world_size}{root}, wrap={run.wrap!r}, "
        f"optim={run.optim!r}, points=[{point!r}], victims=({victims!r},)).text())"
    )


def _sample(points: list[Boundary], max_points: int | None) -> list[Boundary]:
    """`max_points` of `points` spread evenly over every rank's sequence, the first and the
    last always among them (the last is where a pointer usually moves)."""
    if max_points is None or len(points) <= max_points:
        return points
    if max_points <= 1:
        return points[-1:]
    step = (len(points) - 1) / (max_points - 1)
    return [points[round(i * step)] for i in range(max_points)]


def _select(points: list[Boundary], wanted: Iterable[str]) -> list[Boundary]:
    """The boundaries `wanted` names: 'RANK#INDEX' or 'RANK:KIND:PATH' (normalised path)."""
    out = []
    for spec in wanted:
        if "#" in spec:
            found = [b for b in points if b.point == spec]
        else:
            rank, _, rest = spec.partition(":")
            kind, _, path = rest.partition(":")
            found = [b for b in points if str(b.rank) == rank and b.kind == kind and b.path == path]
        if not found:
            raise CheckpointerError(f"crash point {spec!r}: no such boundary (found {[b.point for b in points]})")
        out += found[:1]
    return out


class _Run:
    """One crash check's runs: roots, launches, traces."""

    def __init__(self, ref, world_size, root, wrap, optim, timeout):
        self.ref, self.world_size, self.wrap, self.optim, self.timeout = ref, world_size, wrap, optim, timeout
        self.root = root  # the user's (None: a temporary directory)
        self.work = tempfile.mkdtemp(prefix="ckptlib-crash-check-")
        self.base = root.rstrip("/") if root else os.path.join(self.work, "roots")
        self.base = f"{self.base}/crash-check-{uuid.uuid4().hex[:8]}" if root else self.base
        self.count = 0
        self.env = {"CKPTLIB_S3_MAX_CONCURRENCY": "1"}  # object-store requests in a fixed order

    def fresh(self) -> tuple[str, str]:
        self.count += 1
        traces = os.path.join(self.work, f"trace-{self.count:04d}")
        os.makedirs(traces)
        return f"{self.base}/case-{self.count:04d}", traces

    def launch(self, fn, *args) -> tuple[list[Any], bool]:
        """Per-rank results (exceptions in place of a failed rank's) and whether it hung."""
        from ckptlib.testing.harness.launch_errors import RankTimeout
        from ckptlib.testing.harness.launcher import launch

        try:
            return launch(
                self.world_size, fn, *args, timeout=self.timeout, return_exceptions=True, grace=5.0, env=self.env
            ), False
        except RankTimeout as exc:
            return list(exc.results), True

    def save(self, root: str, traces: str, kill: tuple[int, int, str] | None):
        return self.launch(rank_save, self.ref, root, self.wrap, self.optim, traces, kill)

    def load(self, root: str) -> tuple[str, str, str]:
        """(outcome, detail, problem) of the checkpointer's load of `root`."""
        results, hung = self.launch(rank_load, self.ref, root, self.wrap, self.optim)
        return judge(results, hung)

    def close(self) -> None:
        from ckptlib.storage import is_remote, open_storage

        if is_remote(self.base):
            try:
                open_storage(self.base).delete_tree()
            except Exception:  # noqa: BLE001 - best effort: the report is what counts
                pass
        else:
            shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)


def judge(results: list[Any], hung: bool) -> tuple[str, str, str]:
    """(outcome, detail, problem) from every rank's `rank_load` result."""
    failed = {rank: r for rank, r in enumerate(results) if not isinstance(r, dict)}
    if hung or failed:
        what = "hung" if hung else "crashed"
        rank, error = next(iter(failed.items()), (None, None))
        if error is None:
            return what, "", f"the load {what} (rank {rank} did not return)"
        return what, "", f"the load {what} (rank {rank}: {(str(error).splitlines() or [''])[0]})"
    errors = {rank: r["error"] for rank, r in enumerate(results) if "error" in r}
    if errors:
        rank, error = next(iter(errors.items()))
        return "raised", f"rank {rank}: {error}", ""
    steps = {rank: r["step"] for rank, r in enumerate(results)}
    if len(set(steps.values())) > 1:
        return "mixed", "", f"the ranks resumed different steps: {steps}"
    step = steps[0]
    if step is None:
        return "lost", "", f"the load found no step: step {COMMITTED}, committed before the crash, is lost"
    if step not in (COMMITTED, KILLED):
        return "wrong", "", f"the load resumed step {step}, neither {COMMITTED} (committed) nor {KILLED} (killed)"
    for rank, r in enumerate(results):
        if r["holds"] == step:
            continue
        if r["holds"] is not None:
            return "wrong", "", f"the load resumed step {step}, but rank {rank} holds step {r['holds']}'s state"
        return (
            "half-written",
            "",
            f"the load resumed step {step}, which is not step {step}'s state bit-exactly "
            f"(a half-written step): rank {rank}: {r['differs'][step]}",
        )
    return f"resumed-{step}", "", ""


def crash_check(
    checkpointer: Any,
    *,
    world_size: int = 2,
    root: str | None = None,
    wrap: str = "plain",
    optim: str = "adamw",
    victims: Iterable[str] = VICTIMS,
    max_points: int | None = None,
    points: Iterable[str] | None = None,
    timeout: float = 120.0,
) -> CrashReport:
    """Kill `checkpointer`'s save at each of its write boundaries and judge its load (see the
    module's docstring). `checkpointer`: an object with save/load, a zero-argument factory, or
    a 'module:attr' reference (ranks get it pickled: a reference or a module-level class).
    `root`: where the test roots go (a path or s3://, gs://, az:// URI; default a temporary
    directory); a directory of its own is made there and removed at the end. `wrap`, `optim`:
    the state's model wrapping (plain, ddp, fsdp2) and optimizer, as `ckpt validate` builds it.
    `max_points`: at most that many boundaries (spread evenly, first and last included);
    `points`: exactly these ('RANK#INDEX' or 'RANK:KIND:PATH'). Each runs once per `victims`
    mode. Returns a `CrashReport`; raises CheckpointerError for a reference that names no
    checkpointer or an unknown victims mode or point."""
    resolved = resolve(checkpointer)
    victims = tuple(victims)
    unknown = [v for v in victims if v not in VICTIMS]
    if unknown or not victims:
        raise CheckpointerError(f"victims {victims!r}: expected some of {VICTIMS}")
    name = getattr(resolved, "name", None) or _ref_text(checkpointer)
    from ckptlib.testing.harness.forkserver import add_preload

    add_preload(PRELOAD)  # before the forkserver starts: each launch builds optimizers
    run = _Run(checkpointer if isinstance(checkpointer, str) else resolved, world_size, root, wrap, optim, timeout)
    try:
        return _check(run, checkpointer, name, victims, max_points, points)
    finally:
        run.close()


def _check(run: _Run, ref: Any, name: str, victims, max_points, points) -> CrashReport:
    root, traces = run.fresh()
    results, hung = run.save(root, traces, None)
    bad = [r for r in results if not isinstance(r, dict)]
    if hung or bad:
        raise CheckpointerError(
            f"checkpointer {name}: the undisturbed save of steps {COMMITTED} and {KILLED} did not complete on "
            f"{run.world_size} ranks: {'hung' if hung else bad[0]}"
        )
    boundaries = {
        rank: [Boundary(rank, i, kind, path) for i, kind, path in r["boundaries"]] for rank, r in enumerate(results)
    }
    flat = [b for rank in sorted(boundaries) for b in boundaries[rank]]
    missed = unseen(results[0]["before"], results[0]["after"], flat)
    _, _, baseline = judge_baseline(run.load(root))
    chosen = _select(flat, points) if points is not None else _sample(flat, max_points)
    cases = []
    for boundary in chosen:
        for mode in victims:
            cases.append(_case(run, ref, boundary, mode))
    return CrashReport(name, run.world_size, boundaries, missed, baseline, cases, len(flat) - len(chosen))


def judge_baseline(judged: tuple[str, str, str]) -> tuple[str, str, str]:
    """The undisturbed run's load must resume step 2 bit-exactly; anything else fails it."""
    outcome, detail, problem = judged
    if outcome == f"resumed-{KILLED}":
        return judged
    return outcome, detail, problem or f"the load {outcome} after a save that completed: {detail}".rstrip(": ")


def _case(run: _Run, ref: Any, boundary: Boundary, mode: str) -> CrashCase:
    root, traces = run.fresh()
    run.save(root, traces, (boundary.rank, boundary.index, mode))
    calls = {}
    killed_at = None
    for rank in range(run.world_size):
        seen, at, _ = read_trace(os.path.join(traces, f"rank{rank}.jsonl"))
        calls[rank] = seen
        if rank == boundary.rank:
            killed_at = at
    repro = _reproduction(run, ref, boundary.point, mode)
    case = CrashCase(boundary, mode, "", calls=calls, reproduction=repro)
    if killed_at is None:
        case.outcome = "not-reached"
        case.detail = f"rank {boundary.rank} made {len(calls[boundary.rank])} boundaries this time"
        return case
    died = calls[boundary.rank][killed_at]
    case.outcome, case.detail, case.problem = run.load(root)
    if (died.kind, died.path) != (boundary.kind, boundary.path):
        case.detail += f" (nondeterministic: this run's #{killed_at} was {died.kind} {died.path})"
    return case


__all__ = ["CrashCase", "CrashReport", "VICTIMS", "crash_check", "judge"]
