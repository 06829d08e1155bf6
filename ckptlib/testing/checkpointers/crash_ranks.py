"""What the crash harness for any checkpointer (`crash_check`) runs in each rank: the save of
step 2 after a committed step 1 under the probe (`crash_probe`), and the checkpointer's own
load in a fresh process group, judged against both steps' states bit-exactly.

The state is the elastic matrix's (`ckptlib.testing.matrices.matrix`): its small model wrapped
as `wrap` says, its optimizer, trained `step` steps from seed 0, as ``{"model": ..., "optim":
...}``. Step 1 and step 2 differ in every tensor (one more training step), and the load starts
from a third state (seed 1), so a load that did nothing, or half of its work, is told apart.
Comparisons are of each rank's local tensors (a DTensor's local shard): the world size does
not change between save and load here, so no collective runs after the checkpointer's load.
"""

from __future__ import annotations

import os
from typing import Any

#: The step committed before the save under test, and the step that save writes.
COMMITTED, KILLED = 1, 2
#: How much of a load's error a report keeps (one line).
MESSAGE_CHARS = 400


def build_state(wrap: str, optim: str, step: int, seed: int = 0) -> dict[str, Any]:
    """The harness's state after `step` training steps from `seed` (collective with fsdp2)."""
    from ckptlib.testing.matrices import matrix

    model, opt = matrix.setup(wrap, optim, seed=seed)
    for i in range(1, step + 1):
        matrix.train_step(model, opt, i)
    return {"model": model, "optim": opt}


def local_state(state: dict[str, Any], carries: tuple[str, ...]) -> dict[str, Any]:
    """The entries of `state` named in `carries` as this rank's plain tensors (copies)."""
    import torch

    def local(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            to_local = getattr(obj, "to_local", None)
            value = to_local() if callable(to_local) else obj
            return value.detach().cpu().clone()
        if isinstance(obj, dict):
            return {k: local(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [local(v) for v in obj]
        return obj

    return {name: local(state[name].state_dict()) for name in carries}


def _carries(checkpointer: Any, state: dict[str, Any]) -> tuple[str, ...]:
    carries = getattr(checkpointer, "carries", None)
    return tuple(name for name in state if carries is None or name in carries)


def _probe_roots(root: str) -> dict[str, str]:
    from ckptlib.storage import is_remote

    if is_remote(root):
        return {"objects": root}
    return {"local": root[len("file://") :] if root.startswith("file://") else root}


def rank_save(
    ref: Any, root: str, wrap: str, optim: str, trace_dir: str, kill: tuple[int, int, str] | None
) -> dict[str, Any]:
    """Save step 1 (undisturbed), then step 2 under the probe; with `kill` = (rank, index,
    victims) that rank dies at that boundary. Returns this rank's boundaries, and on rank 0 of
    an undisturbed run the root's files before and after the save of step 2."""
    import torch.distributed as dist

    from ckptlib.testing.checkpointers.crash_probe import Plan, RankProbe, snapshot
    from ckptlib.testing.checkpointers.protocol import resolve
    from ckptlib.testing.matrices import matrix

    rank = dist.get_rank()
    checkpointer = resolve(ref)
    state = build_state(wrap, optim, COMMITTED)
    checkpointer.save(root, COMMITTED, state)
    matrix.train_step(state["model"], state["optim"], KILLED)
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()
    record = kill is None
    before = snapshot(root) if record and rank == 0 else None
    at, victims = (kill[1], kill[2]) if kill is not None and kill[0] == rank else (None, "one")
    plan = Plan(rank, os.path.join(trace_dir, f"rank{rank}.jsonl"), at, victims, tuple(pids))
    probe = RankProbe(plan, **_probe_roots(root))
    probe.install()
    try:
        checkpointer.save(root, KILLED, state)
    finally:
        probe.uninstall()
    dist.barrier()
    after = snapshot(root) if record and rank == 0 else None
    return {"boundaries": [(b.index, b.kind, b.path) for b in probe.seen], "before": before, "after": after}


def rank_load(ref: Any, root: str, wrap: str, optim: str) -> dict[str, Any]:
    """The checkpointer's load into a fresh state; what it returned and which saved state (if
    any) this rank then holds bit-exactly, or the first difference from each."""
    from ckptlib.testing.checkpointers.protocol import resolve

    checkpointer = resolve(ref)
    expected = {}
    carries: tuple[str, ...] = ()
    for step in (COMMITTED, KILLED):  # built before the load: building may be collective
        state = build_state(wrap, optim, step)
        carries = _carries(checkpointer, state)
        expected[step] = local_state(state, carries)
    state = build_state(wrap, optim, 1, seed=1)
    try:
        step = checkpointer.load(root, state)
    except BaseException as exc:  # noqa: BLE001 - a raise is an outcome the harness judges
        return {"error": f"{type(exc).__name__}: {one_line(str(exc))}"}
    got = local_state(state, carries)
    diffs = {s: first_difference(want, got) for s, want in expected.items()}
    return {"step": step, "holds": next((s for s, d in diffs.items() if d is None), None), "differs": diffs}


def one_line(message: str) -> str:
    """An error message on one line, without the tracebacks some embed (DCP's
    CheckpointException carries every rank's), at most MESSAGE_CHARS long."""
    lines = [
        line.strip()
        for line in message.splitlines()
        if line.strip() and not line.startswith((" ", "\t", "Traceback")) and set(line.strip()) - set("^~ ")
    ]
    return " | ".join(lines)[:MESSAGE_CHARS]


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """Where two nested states first differ ('optim.state.0.step: values differ'), bit-exact
    for tensors; None when they are equal."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path}: not a tensor ({type(actual).__name__})"
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return f"{path}: {actual.dtype}{tuple(actual.shape)}, expected {expected.dtype}{tuple(expected.shape)}"
        return None if torch.equal(expected, actual) else f"{path}: values differ"
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            missing = sorted(map(str, set(expected) - set(actual))) if isinstance(actual, dict) else "all"
            return f"{path}: keys differ (missing {missing})"
        for key in expected:
            found = first_difference(expected[key], actual[key], f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(expected) != len(actual):
            return f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, actual)):
            found = first_difference(a, b, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if expected == actual else f"{path}: {actual!r}, expected {expected!r}"


__all__ = [
    "COMMITTED",
    "KILLED",
    "build_state",
    "first_difference",
    "local_state",
    "one_line",
    "rank_load",
    "rank_save",
]
