"""The operations the crash harness (`crash_points`) covers, a registry: each one prepares a
scene (`crash_scene.Scene`: a root with committed steps and a user's files), acts in the child
(where it is killed or fails at a boundary), then checks the invariants in the parent:

* the last committed checkpoint loads bit-exactly, and `latest` names a committed step;
* the user's files are untouched (exact bytes), and nothing but ckptlib's own names appears;
* no lock blocks the next writer (it proceeds, perhaps after a StaleLockWarning);
* the next save (or export, convert, gc) succeeds, and leaves exactly the expected files;
* where the operation failed, it raised a CheckpointError subclass naming the path.

`register` adds an operation (the tiered upload is one more entry).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Callable

from ckptlib.manager.options import Cluster
from ckptlib.testing.harness.crash_points import Outcome
from ckptlib.testing.harness.crash_scene import (
    CHECKPOINT_FILES,
    Scene,
    assert_committed_or_absent,
    assert_state,
    assert_tree,
    debris,
    state,
    template,
)

STEP = "step_{:010d}".format


@dataclasses.dataclass(frozen=True)
class Operation:
    """One operation under test: `prepare(scene)` in the parent, `act(scene)` in the child,
    `check(scene, outcome)` in the parent afterwards (raises AssertionError)."""

    name: str
    backends: tuple[str, ...]
    prepare: Callable[[Scene], None]
    act: Callable[[Scene], object]
    check: Callable[[Scene, Outcome], None]


OPERATIONS: dict[str, Operation] = {}


def register(operation: Operation) -> Operation:
    OPERATIONS[operation.name] = operation
    return operation


def _quiet(fn, *args, **kwargs):
    """Call fn; a StaleLockWarning (a killed writer's lock) is expected, and so is the warning
    that a step directory keeps the user's file; anything else is not."""
    from ckptlib.manager.cleanup import ForeignFilesWarning
    from ckptlib.manager.lock import StaleLockWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    others = [w for w in caught if not issubclass(w.category, (StaleLockWarning, ForeignFilesWarning))]
    assert not others, f"{fn.__qualname__} warned: {[str(w.message) for w in others]}"
    return result


#: Debris the next writer may leave: the temporary file of a lock or `latest` pointer whose
#: writer was killed before its rename or link (a few bytes, never read; removing another
#: writer's in-flight temporary would break its lock attempt, so nothing guesses).
TOLERATED_DEBRIS = re.compile(r"^(ckptlib\.lock|latest)\.tmp-[0-9a-f]{8}$")


def _assert_clean(scene: Scene, clean: set[str]) -> None:
    left = [name for name in debris(scene, clean) if not TOLERATED_DEBRIS.match(name)]
    assert not left, f"{scene.root}: ckptlib's debris is left after the next writer ran: {left}"


# ---------------------------------------------------------------- ckptlib.save / async_save


def _prepare_save(scene: Scene) -> None:
    import ckptlib

    ckptlib.save(scene.uri("ck1"), state(1))
    scene.plant("notes.txt", "ck1/notes.txt")
    scene.data["ck1"] = scene.tree("ck1")


def _check_save(scene: Scene, outcome: Outcome) -> None:
    import ckptlib

    scene.assert_user_files()
    # ck1 was committed before: byte for byte what it was (so it loads as it did)
    assert scene.tree("ck1") == scene.data["ck1"], "ck1, committed before, was changed"
    committed = assert_committed_or_absent(scene, "ck2", 2)
    assert committed or outcome.status != "completed", "the save returned, yet ck2 is not committed"
    _quiet(ckptlib.save, scene.uri("ck2"), state(3), overwrite=True)
    assert_tree(scene, set(CHECKPOINT_FILES), "ck2")
    _assert_clean(
        scene, {"notes.txt", *(f"ck1/{n}" for n in scene.data["ck1"]), *(f"ck2/{n}" for n in CHECKPOINT_FILES)}
    )


def _act_save(scene: Scene) -> None:
    import ckptlib

    ckptlib.save(scene.uri("ck2"), state(2))


def _act_async_save(scene: Scene) -> None:
    import ckptlib

    # The thread writer: the probes see this process's writes only, and the default ("auto")
    # writes the shard from a writer process, whose boundaries would go unenumerated.
    ckptlib.async_save(scene.uri("ck2"), state(2), async_mode="thread").wait()


register(Operation("save", ("local", "s3"), _prepare_save, _act_save, _check_save))
register(Operation("async-save", ("local", "s3"), _prepare_save, _act_async_save, _check_save))


# ---------------------------------------------------------------- CheckpointManager.save, keep_last=1


def _prepare_manager(scene: Scene) -> None:
    from ckptlib.manager.manager import CheckpointManager

    CheckpointManager(scene.root, keep_last=1).save(1, state(1))
    scene.plant("notes.txt", f"{STEP(1)}/notes.txt")


def _act_manager(scene: Scene) -> None:
    from ckptlib.manager.manager import CheckpointManager

    CheckpointManager(scene.root, keep_last=1).save(2, state(2))


def _assert_latest(scene: Scene, allowed: set[int]) -> int:
    """`latest` names a committed step among `allowed`, which loads bit-exactly through the manager."""
    from ckptlib.manager.manager import CheckpointManager

    mgr = CheckpointManager(scene.root)
    latest = mgr.latest()
    assert latest in allowed, f"latest is {latest}, expected one of {sorted(allowed)}"
    got = template()
    assert mgr.load(got) == latest
    assert_state(got, latest, f"{scene.root} latest")
    return latest


def _check_manager(scene: Scene, outcome: Outcome) -> None:
    from ckptlib.manager.manager import CheckpointManager

    scene.assert_user_files()
    _assert_latest(scene, {2} if outcome.status == "completed" else {1, 2})
    mgr = CheckpointManager(scene.root, keep_last=1)
    _quiet(mgr.save, 3, state(3))
    assert mgr.latest() == 3 and mgr.steps() == [3], f"steps {mgr.steps()} after the next save"
    _assert_clean(
        scene,
        {"latest", "notes.txt", f"{STEP(1)}/notes.txt", *(f"{STEP(3)}/{n}" for n in CHECKPOINT_FILES)},
    )


register(Operation("manager-retention", ("local", "s3"), _prepare_manager, _act_manager, _check_manager))


# ---------------------------------------------------------------- gc (`ckpt gc --keep-last 1`)


def _prepare_gc(scene: Scene) -> None:
    from ckptlib.manager.manager import CheckpointManager

    mgr = CheckpointManager(scene.root)
    for step in (1, 2, 3):
        mgr.save(step, state(step))
    scene.plant("notes.txt", f"{STEP(1)}/notes.txt")
    scene.storage(STEP(4)).write("__0_0.distcp", b"a crashed save's partial shard")  # debris gc removes


def _act_gc(scene: Scene) -> list[str]:
    from ckptlib.manager.manager import CheckpointManager

    return CheckpointManager(scene.root, keep_last=1).gc()


def _check_gc(scene: Scene, outcome: Outcome) -> None:
    from ckptlib.manager.manager import CheckpointManager

    scene.assert_user_files()
    _assert_latest(scene, {3})
    for step in (1, 2):
        assert_committed_or_absent(scene, STEP(step), step)
    mgr = CheckpointManager(scene.root, keep_last=1)
    _quiet(mgr.save, 4, state(4))
    _quiet(mgr.gc)
    assert mgr.latest() == 4 and mgr.steps() == [4], f"steps {mgr.steps()} after the next save and gc"
    _assert_clean(
        scene,
        {"latest", "notes.txt", f"{STEP(1)}/notes.txt", *(f"{STEP(4)}/{n}" for n in CHECKPOINT_FILES)},
    )


register(Operation("gc", ("local", "s3"), _prepare_gc, _act_gc, _check_gc))


# ---------------------------------------------------------------- convert --to dcp


def _prepare_convert(scene: Scene) -> None:
    import ckptlib

    ckptlib.save(scene.uri("src"), state(1))
    scene.plant("notes.txt", "src/notes.txt")
    scene.data["src"] = scene.tree("src")


def _act_convert(scene: Scene) -> None:
    import ckptlib

    ckptlib.convert(scene.uri("src"), scene.uri("out"), to="dcp")


def _check_convert(scene: Scene, outcome: Outcome) -> None:
    import ckptlib

    scene.assert_user_files()
    assert scene.tree("src") == scene.data["src"], "the source checkpoint was changed"
    committed = assert_committed_or_absent(scene, "out", 1)
    assert committed or outcome.status != "completed", "convert returned, yet its output is not committed"
    _quiet(ckptlib.convert, scene.uri("src"), scene.uri("out"), to="dcp", force=True)
    assert_tree(scene, set(CHECKPOINT_FILES), "out")
    _assert_clean(
        scene, {"notes.txt", *(f"src/{n}" for n in scene.data["src"]), *(f"out/{n}" for n in CHECKPOINT_FILES)}
    )


register(Operation("convert", ("local", "s3"), _prepare_convert, _act_convert, _check_convert))


# ---------------------------------------------------------------- export --force over an earlier export

EXPORT_FILES = frozenset({"model.safetensors", "ckptlib_export.json"})


def _export_dir(scene: Scene) -> str:
    return f"{scene.local}/export"


def _prepare_export(scene: Scene) -> None:
    import os

    import ckptlib

    ckptlib.save(scene.uri("ck1"), state(1))
    ckptlib.save(scene.uri("ck2"), state(2))
    ckptlib.export(scene.uri("ck1"), _export_dir(scene))
    with open(os.path.join(_export_dir(scene), "README.md"), "wb") as f:
        f.write(b"the user's model card\n")


def _exported(scene: Scene) -> dict[str, bytes] | None:
    """The export's tensors, if its record says it is complete."""
    import os

    from safetensors.torch import load_file

    from ckptlib.format.output import read_record

    record = read_record(_export_dir(scene))
    if record is None or not record.get("complete"):
        return None
    return load_file(os.path.join(_export_dir(scene), "model.safetensors"))


def _check_export(scene: Scene, outcome: Outcome) -> None:
    import os

    import torch

    import ckptlib

    readme = os.path.join(_export_dir(scene), "README.md")
    with open(readme, "rb") as f:
        assert f.read() == b"the user's model card\n", f"{readme}: the user's file was changed"
    tensors = _exported(scene)
    if outcome.status == "completed":
        assert tensors is not None, "export returned, yet its record is not complete"
    if tensors is not None:  # a complete export is one step's tensors, bit-exactly
        step = 2 if torch.equal(tensors["w"], state(2)["w"]) else 1
        assert torch.equal(tensors["w"], state(step)["w"]) and torch.equal(tensors["b"], state(step)["b"])
        assert step == 2 or outcome.status != "completed"
    _quiet(ckptlib.export, scene.uri("ck2"), _export_dir(scene), force=True)
    tensors = _exported(scene)
    assert tensors is not None and torch.equal(tensors["w"], state(2)["w"]) and torch.equal(tensors["b"], state(2)["b"])
    got = set(os.listdir(_export_dir(scene)))
    assert got == {*EXPORT_FILES, "README.md"}, f"{_export_dir(scene)} holds {sorted(got)} after the next export"


def _act_export(scene: Scene) -> None:
    import ckptlib

    ckptlib.export(scene.uri("ck2"), _export_dir(scene), force=True)


# Local only: export writes a local directory (an object-store destination is refused), and
# reading its source from S3 writes nothing there, so an S3 source adds no boundary.
register(Operation("export", ("local",), _prepare_export, _act_export, _check_export))


# ---------------------------------------------------------------- the cluster tier's upload


def _tier(scene: Scene):
    """A manager whose node-local root is local/node and whose remote is the scene's root; a
    failed upload is an error here (`RemoteLag(steps=0)`), so each boundary's failure is seen
    raised (the default leaves the step local with a warning: tests/manager/test_remote_lag.py)."""
    import ckptlib

    remote = ckptlib.RemoteTier(scene.root, keep_last=1, upload_concurrency=1)
    cluster = Cluster(remote=remote, remote_lag=ckptlib.RemoteLag(steps=0))
    return ckptlib.CheckpointManager(f"{scene.local}/node", keep_last=1, cluster=cluster)


def _prepare_tier(scene: Scene) -> None:
    mgr = _tier(scene)
    mgr.save(1, state(1))
    mgr.wait()
    mgr.close()
    scene.plant("notes.txt", f"{STEP(1)}/notes.txt")


def _act_tier(scene: Scene) -> None:
    mgr = _tier(scene)
    mgr.save(2, state(2))
    mgr.wait()
    mgr.close()


def _check_tier(scene: Scene, outcome: Outcome) -> None:
    from ckptlib.manager.manager import CheckpointManager

    scene.assert_user_files()
    _assert_latest(scene, {2} if outcome.status == "completed" else {1, 2})
    mgr = _tier(scene)
    _quiet(mgr.save, 3, state(3))
    _quiet(mgr.wait)
    mgr.close()
    assert CheckpointManager(scene.root).latest() == 3, "the next save's upload did not move the remote latest"
    _assert_clean(
        scene,
        {"latest", "notes.txt", f"{STEP(1)}/notes.txt", *(f"{STEP(3)}/{n}" for n in CHECKPOINT_FILES)},
    )


def _has_remote_tier() -> bool:
    import ckptlib

    return hasattr(ckptlib, "RemoteTier")


if _has_remote_tier():  # the cluster tier (issue 24): one more entry once it is on this branch
    register(Operation("tiered-upload", ("local", "s3"), _prepare_tier, _act_tier, _check_tier))


__all__ = ["OPERATIONS", "Operation", "register"]
