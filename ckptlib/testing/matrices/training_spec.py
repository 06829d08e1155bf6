"""The user's training job as ``ckpt validate --spec`` and ``ckptlib.testing.assert_elastic`` see it.

A spec is a :class:`TrainingSpec`, or any object (typically a module) with factory functions
of the same names, referenced as ``pkg.module:NAME``, ``path/to/file.py:NAME`` or just
``pkg.module`` / ``path/to/file.py`` (the module itself is the spec). Only ``build_model``
is required:

- ``build_model(seed) -> nn.Module``: a fresh, unwrapped model; different seeds must give
  different weights (the load side starts from another seed, so a load that did nothing fails).
- ``build_optimizers(model) -> Optimizer | {name: Optimizer}``: over the *parallelized* model's
  parameters (default: one AdamW, lr 1e-2, saved as ``"optim"``).
- ``build_schedulers(optimizers) -> scheduler | {name: scheduler}``: given ``{name: Optimizer}``.
- ``build_state(rank, world_size) -> {name: object}``: the rest of the state: ``ckptlib.RankLocal``
  objects (per-rank state such as ``ckptlib.RNGState()``, a data loader with
  ``policy=ckptlib.MergeSamplerProgress()``) and objects with ``state_dict()`` /
  ``load_state_dict()`` that are the same on every rank. ``rank``/``world_size`` are those of
  the ranks running this case (a subgroup of a bigger launch): build samplers with them.
- ``train_step(training, step)``: one training step (forward, backward, every optimizer and
  scheduler step) on a :class:`Training`; or ``loss(model, batch)`` and, optionally,
  ``batch(training, step)`` (default: ``training.next_batch()`` when the state has exactly one
  data loader, else ``step``): the default step backpropagates the loss, steps every optimizer
  (then zeroes the gradients) and every scheduler.
- ``fsdp_units(model)``, ``tp_plan(model)``, ``after_tp(model)``: how the ``fsdp2``/``hsdp``,
  ``tp``/``fsdp2+tp`` layouts shard the unwrapped model (default: the model's own methods of
  those names, see ``parallel_layouts.apply_layout``).
- ``layouts`` (default ``("fsdp2",)``), ``steps`` (training steps before the save, default 2).

A failure in any of these on any rank is a :class:`SpecFactoryError` naming the rank and the
function, with the traceback; a spec that cannot be imported or is incomplete is a
:class:`SpecError`. This module does not import torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any, Callable, Sequence

from ckptlib.errors import CheckpointError

FACTORIES = (
    "build_model",
    "build_optimizers",
    "build_schedulers",
    "build_state",
    "train_step",
    "loss",
    "batch",
    "fsdp_units",
    "tp_plan",
    "after_tp",
)


class SpecError(CheckpointError):
    """A training spec cannot be used: it does not import, lacks ``build_model``, or a name is wrong."""


class SpecFactoryError(SpecError):
    """One of the spec's functions raised on a rank; the message has the rank and its traceback."""


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """A training job to prove elastic: see the module docstring for every field."""

    build_model: Callable[[int], Any]
    build_optimizers: Callable[[Any], Any] | None = None
    build_schedulers: Callable[[dict], Any] | None = None
    build_state: Callable[[int, int], Any] | None = None
    train_step: Callable[[Any, int], None] | None = None
    loss: Callable[[Any, Any], Any] | None = None
    batch: Callable[[Any, int], Any] | None = None
    fsdp_units: Callable[[Any], Any] | None = None
    tp_plan: Callable[[Any], Any] | None = None
    after_tp: Callable[[Any], None] | None = None
    layouts: Sequence[str] = ("fsdp2",)
    steps: int = 2
    name: str = ""

    def __post_init__(self):
        if not callable(self.build_model):
            raise SpecError(f"spec {self.label}: build_model must be a function, got {self.build_model!r}")
        for field in FACTORIES[1:]:
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise SpecError(f"spec {self.label}: {field} must be a function, got {type(value).__name__}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise SpecError(f"spec {self.label}: steps must be a positive int, got {self.steps!r}")
        if isinstance(self.layouts, str) or not self.layouts:
            raise SpecError(f"spec {self.label}: layouts must be a non-empty sequence of names, got {self.layouts!r}")

    @property
    def label(self) -> str:
        return self.name or getattr(self.build_model, "__module__", "") or "spec"


def _from_namespace(obj: Any, label: str) -> TrainingSpec:
    """A TrainingSpec from an object's (a module's) attributes of the factory names."""
    if not callable(getattr(obj, "build_model", None)):
        found = sorted(name for name in FACTORIES if getattr(obj, name, None) is not None)
        raise SpecError(
            f"spec {label}: no build_model function (found: {', '.join(found) or 'none of ' + ', '.join(FACTORIES)}); "
            "a spec is a ckptlib.testing.TrainingSpec or a module with build_model(seed) and optional "
            f"{', '.join(FACTORIES[1:])}"
        )
    kwargs = {name: getattr(obj, name) for name in FACTORIES if getattr(obj, name, None) is not None}
    for name in ("layouts", "steps"):
        value = getattr(obj, name.upper(), None)
        if value is not None:
            kwargs[name] = tuple(value) if name == "layouts" else value
    return TrainingSpec(**kwargs, name=label)


def as_training_spec(obj: Any, label: str = "") -> TrainingSpec:
    """`obj` as a TrainingSpec: itself, a ``layout_matrix.ModelSpec`` (build, loss by step,
    layout hooks, its optimizer with kind "adamw"), or an object with the factory functions."""
    if isinstance(obj, TrainingSpec):
        return obj if obj.name or not label else dataclasses.replace(obj, name=label)
    if type(obj).__name__ == "ModelSpec" and hasattr(obj, "build") and hasattr(obj, "loss"):
        optimizer = obj.optimizer
        return TrainingSpec(
            build_model=obj.build,
            build_optimizers=None if optimizer is None else _ModelSpecOptimizer(optimizer),
            loss=obj.loss,
            fsdp_units=obj.fsdp_units,
            tp_plan=obj.tp_plan,
            after_tp=obj.after_tp,
            name=label or getattr(obj.build, "__module__", ""),
        )
    return _from_namespace(obj, label or getattr(obj, "__name__", type(obj).__name__))


@dataclasses.dataclass(frozen=True)
class _ModelSpecOptimizer:
    """A ModelSpec's ``optimizer(params, kind)`` as a ``build_optimizers(model)``."""

    make: Callable[[Any, str], Any]

    def __call__(self, model: Any) -> Any:
        return self.make(model.parameters(), "adamw")


def _import_file(path: str) -> Any:
    name = "ckptlib_spec_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"spec {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # the file's own imports of modules beside it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _is_file_ref(module_part: str) -> bool:
    return module_part.endswith(".py") or os.sep in module_part or "/" in module_part


def resolve_reference(ref: str) -> str:
    """`ref` with a file path made absolute (ranks may run in another directory)."""
    module_part, sep, attr = ref.partition(":")
    if _is_file_ref(module_part):
        return os.path.abspath(module_part) + sep + attr
    return ref


def load_spec(ref: str) -> TrainingSpec:
    """The TrainingSpec that `ref` names: ``pkg.module:NAME``, ``file.py:NAME``, or a module or
    file alone. NAME may be a TrainingSpec, a ModelSpec, an object with the factory functions,
    or a function of no arguments returning one of those. The current directory is importable
    (as with ``python -m``). Raises SpecError with the import's traceback."""
    if not isinstance(ref, str) or not ref.strip():
        raise SpecError(f"spec reference must be 'pkg.module:NAME' or 'path/file.py:NAME', got {ref!r}")
    module_part, _, attr = ref.strip().partition(":")
    try:
        if _is_file_ref(module_part):
            if not os.path.isfile(module_part):
                raise SpecError(f"spec {ref}: no such file {module_part}", path=module_part)
            module = _import_file(module_part)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_part)
    except SpecError:
        raise
    except BaseException as exc:  # noqa: BLE001 - anything the user's module raises on import
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise SpecError(f"spec {ref}: importing {module_part} failed:\n{_traceback_text(exc)}") from exc
    obj: Any = module
    for part in [p for p in attr.split(".") if p] if attr else []:
        if not hasattr(obj, part):
            raise SpecError(f"spec {ref}: {module_part} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, type) and not hasattr(obj, "build_model") and attr:
        obj = call_user(obj, f"{ref}()", rank=None)
    return as_training_spec(obj, ref)


def _traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def call_user(fn: Callable[..., Any], what: str, *args: Any, rank: int | None) -> Any:
    """Call one of the user's functions; its failure becomes a SpecFactoryError with the rank
    and the traceback (ckptlib's own errors, e.g. from a load inside it, pass through)."""
    try:
        return fn(*args)
    except (SpecError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's code: any failure is reported
        where = "" if rank is None else f"rank {rank}: "
        raise SpecFactoryError(
            f"{where}{what} raised {type(exc).__name__}: {exc}\n{_traceback_text(exc)}", rank=rank
        ) from exc


__all__ = [
    "FACTORIES",
    "SpecError",
    "SpecFactoryError",
    "TrainingSpec",
    "as_training_spec",
    "call_user",
    "load_spec",
    "resolve_reference",
]
