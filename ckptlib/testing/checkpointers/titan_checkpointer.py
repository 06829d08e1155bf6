"""torchtitan's checkpointer behind the harness's protocol: its own ``CheckpointManager`` (DCP,
``ROOT/checkpoint/step-N`` folders, the newest folder holding a ``.metadata`` is the one it
resumes), with the containers torchtitan's Trainer hands it built by hand around the
harness's model and optimizers (torchtitan cannot train on CPU; tests/clients/test_torchtitan.py
does the same):

- the model as ``model_parts=[model]`` (torchtitan saves its keys at the top level);
- the optimizers in an ``OptimizersContainer`` (torchtitan's flat, FQN-keyed optimizer state).
  torchtitan builds its optimizers from ``(name, parameter)`` pairs and its flat state needs the
  ``param_names`` that gives every param group (an optimizer over bare parameters raises
  "Optimizer must be built with (name, param) tuples"): for the save or load only, the adapter
  gives each group the names of its parameters in the model, as torchtitan's build would;
- every other object with a state dict that is the same on every rank (the harness's
  schedulers and stateful extras) and the plain values (``step``) in ``states``, where the
  Trainer puts its ``train_state``. The step a load returns is the one torchtitan restored.

What it does not carry: per-rank state (``ckptlib.RankLocal``). torchtitan keeps per-rank state
only in its data loader (``ParallelAwareDataloader``: a ``dp_rank_N`` key per rank plus the
saved ``world_size``), which asserts the DP size is unchanged on load ("dataloader resharding is
not supported yet"); examples/conformance/torchtitan_dataloader_resize.py reproduces it. The
adapter passes no data loader (``dataloader=None``), as a model-only trainer would.

Reference: ``ckptlib.testing.checkpointers:torchtitan`` (or this module's ``TorchtitanCheckpointer``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ckptlib.testing.checkpointers.adapter_state import (
    Carries,
    Values,
    every_entry_but_per_rank,
    package_version,
    parts,
)

VALUES = "ckptlib_values"


@contextlib.contextmanager
def _named(model: Any, optimizers: list[Any]) -> Iterator[None]:
    """Each param group of `optimizers` holds ``param_names`` (the FQNs in `model` of its
    parameters) while the block runs, as torchtitan's optimizers do; an optimizer whose groups
    had none loses them again afterwards (a load replaces the group dicts: all are cleaned)."""
    names = {id(p): n for n, p in model.named_parameters()}
    unnamed = [optim for optim in optimizers if any("param_names" not in g for g in optim.param_groups)]
    for optim in unnamed:
        for group in optim.param_groups:
            group["param_names"] = [names[id(p)] for p in group["params"]]
    try:
        yield
    finally:
        for optim in unnamed:
            for group in optim.param_groups:
                group.pop("param_names", None)


class PendingSave:
    """An async save in flight: ``wait()`` blocks until torchtitan has written the step."""

    def __init__(self, manager: Any):
        self.manager = manager

    def wait(self) -> None:
        try:
            self.manager.maybe_wait_for_saving()
        finally:
            self.manager.close()


class TorchtitanCheckpointer:
    """torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpoint``), synchronous
    saves, every step kept (``keep_latest_k=0``) unless told otherwise."""

    name = "torchtitan"

    def __init__(self, *, folder: str = "checkpoint", keep_latest_k: int = 0):
        self.folder = folder
        self.keep_latest_k = keep_latest_k
        self.carries = Carries(every_entry_but_per_rank)  # every entry but the per-rank ones

    @property
    def version(self) -> str | None:
        return package_version("torchtitan")

    def where(self, root: str) -> str:
        """The folder the step-N folders go to."""
        import os

        return os.path.join(root, self.folder)

    def _manager(self, root: str, state: dict[str, Any], values: Values, async_mode: str = "disabled") -> Any:
        self.carries.note(state)
        from torchtitan.components.checkpoint import CheckpointManager
        from torchtitan.components.optimizer import OptimizersContainer

        p = parts(state, self.name)
        # torchtitan builds its OptimizersContainer from a config; the harness built the optimizers
        # already: the container's state dict only reads `optimizers` (and `model_parts`).
        optimizers = OptimizersContainer.__new__(OptimizersContainer)
        optimizers.optimizers = list(p.optimizers.values())
        optimizers.model_parts = [p.model]
        config = CheckpointManager.Config(
            enable=True,
            folder=self.folder,
            interval=1,
            keep_latest_k=self.keep_latest_k,
            last_save_model_only=False,
            async_mode=async_mode,
        )
        states = {**p.stateful, VALUES: values}
        return CheckpointManager(
            config,
            dataloader=None,
            model_parts=[p.model],
            optimizers=optimizers,
            lr_schedulers=None,
            states=states,
            sd_adapter=None,
            base_folder=root,
        )

    def save(self, root: str, step: int, state: dict[str, Any]) -> None:
        p = parts(state, self.name)
        values = Values({**p.values, "step": step})
        manager = self._manager(root, state, values)
        try:
            with _named(p.model, list(p.optimizers.values())):
                manager.save(curr_step=step)
        finally:
            manager.close()

    def async_save(self, root: str, step: int, state: dict[str, Any]) -> "PendingSave":
        """torchtitan's ``async_mode="async"``: DCP's ``async_save`` on a gloo group of its own;
        returns once the state is staged; ``wait()`` returns once the step is written."""
        p = parts(state, self.name)
        values = Values({**p.values, "step": step})
        manager = self._manager(root, state, values, async_mode="async")
        try:
            with _named(p.model, list(p.optimizers.values())):  # staged before save() returns
                manager.save(curr_step=step)
        except BaseException:
            manager.close()
            raise
        return PendingSave(manager)

    def load(self, root: str, state: dict[str, Any]) -> int | None:
        p = parts(state, self.name)
        values = Values({**p.values, "step": None})  # DCP loads the keys it is given
        manager = self._manager(root, state, values)
        try:
            with _named(p.model, list(p.optimizers.values())):
                loaded = manager.load(step=-1)
        finally:
            manager.close()
        if not loaded:
            return None
        values.restore(state)
        return values.values["step"]


__all__ = ["PendingSave", "TorchtitanCheckpointer"]
