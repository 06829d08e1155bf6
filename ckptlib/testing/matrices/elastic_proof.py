"""`assert_elastic`: ``ckpt validate --spec`` as one call in a user's pytest.

    from ckptlib.testing import assert_elastic

    def test_my_job_resumes_anywhere():
        assert_elastic("mypkg.training:SPEC", world_sizes=(1, 2, 3), layouts=("fsdp2", "tp"))

Outside a process group it launches max(world_sizes) local gloo ranks (the test launcher's
forkserver) on a temporary directory, or ``root``; called on every rank of an initialized
process group (a test run under torchrun) it uses those ranks, and ``root`` must be a place
every rank reaches. Passes silently (returning the report); a failing pair raises
:class:`ElasticAssertionError` with the matrix and each failing pair's reason; a spec that does
not import or whose functions raise raises its :class:`training_spec.SpecError` (rank and
traceback). ``checkpointer=`` proves another checkpointer than ckptlib's manager on the same job
(``ckptlib.testing.checkpointers``: plain DCP's adapter, or your own object with collective
``save(root, step, state)`` and ``load(root, state) -> step``).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any, Sequence

from ckptlib.testing.matrices.training_spec import SpecError, as_training_spec, load_spec, resolve_reference


class ElasticAssertionError(AssertionError):
    """Some (save, load) pair of `assert_elastic` failed; `report` is the whole run."""

    def __init__(self, message: str, report: Any):
        super().__init__(message)
        self.report = report


def _spec_arg(spec: Any) -> tuple[Any, Any]:
    """(what the ranks get: a reference string or the spec object, the TrainingSpec here)."""
    if isinstance(spec, str):
        ref = resolve_reference(spec)
        return ref, load_spec(ref)
    return spec, as_training_spec(spec)


def assert_elastic(
    spec: Any,
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    layouts: Sequence[str] | None = None,
    *,
    pairs: str = "all",
    root: str | None = None,
    timeout: float = 600.0,
    progress: bool = False,
    checkpointer: Any = None,
):
    """Save the spec's training job at every (layout, N) and load it at every (layout, M);
    every part of the state must come back bit-exactly and one more step must match a
    never-checkpointed run (see ``spec_matrix``). `spec`: a ``TrainingSpec``, a module or
    object with the factory functions, or a reference ``"pkg.module:NAME"`` /
    ``"path/file.py:NAME"``. `layouts`: default the spec's. `pairs="covering"`: one case per
    (save layout, load layout) pair. `checkpointer`: what saves and loads (a
    ``ckptlib.testing.checkpointers`` protocol object, a zero-argument factory or a
    ``"module:attr"`` reference; default ckptlib's ``CheckpointManager``); the entries it does
    not carry are not compared (each cell's ``not_carried``). Returns the ``validate.Report``."""
    from ckptlib.testing.matrices import parallel_layouts, validate

    shipped, training_spec = _spec_arg(spec)
    sizes = sorted(set(int(n) for n in world_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"world_sizes must be positive integers, got {world_sizes!r}")
    names = parallel_layouts.parse_layouts(",".join(layouts or training_spec.layouts))
    if not validate.layouts_fit(names, sizes):
        raise ValueError(f"no world size in {sizes} suits the layouts {names} (2-D layouts run at even sizes from 4)")
    if pairs not in ("all", "covering"):
        raise ValueError(f"pairs must be 'all' or 'covering', got {pairs!r}")
    if checkpointer is not None:
        from ckptlib.testing.checkpointers.protocol import resolve

        resolve(checkpointer)  # a CheckpointerError here, before any rank starts
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        doc = _in_group(root, sizes, names, pairs, shipped, progress, checkpointer)
    else:
        doc = _launched(root, sizes, names, pairs, shipped, progress, timeout, checkpointer)
    report = validate.report_from_json(doc)
    if not report.ok:
        raise ElasticAssertionError(f"elastic round trip of {training_spec.label} failed:\n{report.table()}", report)
    return report


def _launched(root, sizes, names, pairs, shipped, progress, timeout, checkpointer) -> dict:
    from ckptlib.testing.harness.launch_errors import RankError
    from ckptlib.testing.harness.launcher import launch
    from ckptlib.testing.matrices import validate

    with tempfile.TemporaryDirectory(prefix="assert-elastic-") as tmp:
        try:
            results = launch(
                max(sizes),
                validate.rank_entry,
                root or tmp,
                sizes,
                "",
                "adamw",
                progress,
                names,
                pairs,
                shipped,
                checkpointer,
                timeout=timeout,
            )
        except RankError as exc:
            error = spec_error_of(exc)
            if error is not None:
                raise error from None
            raise
    return results[0]


def spec_error_of(exc: Any) -> SpecError | None:
    """The SpecError that stopped a launch (a `RankError`): the first rank's to fail, since the
    others may only have seen that rank go away."""
    failures = sorted(exc.failures.values(), key=lambda f: (not f.first, f.rank))
    return next((f.exception for f in failures if isinstance(f.exception, SpecError)), None)


def _in_group(root, sizes, names, pairs, shipped, progress, checkpointer) -> dict:
    """Every rank of the initialized group runs the pairs; every rank gets rank 0's report."""
    import torch.distributed as dist

    from ckptlib.testing.matrices import validate

    made = tempfile.mkdtemp(prefix="assert-elastic-") if root is None and dist.get_rank() == 0 else None
    box = [root or made]
    dist.broadcast_object_list(box, src=0)
    try:
        report = validate.run_layout_pairs(
            box[0], sizes, names, "adamw", pairs=pairs, progress=progress, spec=shipped, checkpointer=checkpointer
        )
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
    doc = [None if report is None else report.to_json()]
    dist.broadcast_object_list(doc, src=0)
    return doc[0]


__all__ = ["ElasticAssertionError", "assert_elastic", "spec_error_of"]
