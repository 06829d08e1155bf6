"""The plan cache's parts in one process (issue 25.2): what the structure fingerprint sees
and ignores, what it cannot describe (never reused), and the bounded module-level caches of
plain `ckptlib.save` calls. The multi-rank behaviour is in test_plan_cache.py."""

from __future__ import annotations

import os

import torch

import ckptlib
from ckptlib.format.write import plan_cache
from ckptlib.format.write.dcp_writer import CkptWriter
from ckptlib.saving.saving import transact
from ckptlib.storage import as_storage


def _save(path, state, cache):
    return transact(
        as_storage(path), state, step=None, metadata=None, metrics=None, overwrite=False, group=None, plan_cache=cache
    )


class _Subclass(torch.Tensor):
    pass


def test_what_the_fingerprint_cannot_describe_is_never_reused(tmp_path):
    """Tensor subclasses (and objects that plan their own items) plan every save."""
    flat = {"w": torch.zeros(2), "p": torch.nn.Parameter(torch.zeros(2)), "step": 3}
    mappings = {k: (k,) for k in flat}
    assert plan_cache.fingerprint(flat, mappings, (0,), 0) is not None
    assert plan_cache.fingerprint({**flat, "s": torch.zeros(2).as_subclass(_Subclass)}, mappings, (0,), 0) is None
    cache = plan_cache.PlanCache()
    state = {"s": torch.arange(3.0).as_subclass(_Subclass), "step": 1}
    assert [_save(str(tmp_path / f"c{k}"), state, cache).plan_reused for k in range(2)] == [False, False]
    assert cache.entry is None


def test_values_never_change_the_fingerprint_and_the_structure_always_does():
    base = {"w": torch.zeros(2, 3), "step": 3, "name": "a"}
    mappings = {k: (k,) for k in base}

    def fp(flat, maps=mappings):
        return plan_cache.fingerprint(flat, maps, (0, 1), 0)

    assert fp(base) == fp({"w": torch.ones(2, 3), "step": 4, "name": "a" * 100})
    for other in [
        {**base, "w": torch.zeros(3, 2)},
        {**base, "w": torch.zeros(2, 3, dtype=torch.float64)},
        {**base, "w": torch.zeros(2, 3, requires_grad=True)},
        {**base, "step": torch.tensor(3)},
        {"step": 3, "name": "a", "w": torch.zeros(2, 3)},  # the same keys in another order
    ]:
        assert fp(other) != fp(base)
    assert fp(base, {**mappings, "w": ("w", 0)}) != fp(base)
    assert plan_cache.fingerprint(base, mappings, (0, 1), 1) != fp(base)
    assert plan_cache.fingerprint(base, mappings, (0, 2), 0) != fp(base)


def test_plain_saves_share_a_bounded_cache_per_group_and_storage_kind(tmp_path):
    plan_cache.clear_shared()
    state = {"w": torch.zeros(2), "step": 1}
    assert [ckptlib.save(tmp_path / f"c{k}", state).plan_reused for k in range(2)] == [False, True]
    first = plan_cache.shared((0,), "kind-0")
    assert plan_cache.shared((0,), "kind-0") is first and plan_cache.shared((1,), "kind-0") is not first
    for kind in range(1, plan_cache.SHARED_CACHES + 1):
        plan_cache.shared((0,), f"kind-{kind}")
    assert plan_cache.shared((0,), "kind-0") is not first  # least recently used: evicted


def _metadata(path) -> bytes:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return f.read()


def test_a_reused_plan_writes_the_metadata_of_a_planned_save_and_reports_its_seconds(tmp_path, monkeypatch):
    original = CkptWriter.storage_meta

    def fixed(self):  # one checkpoint path in every `.metadata`: files compare byte for byte
        meta = original(self)
        meta.checkpoint_id = "<checkpoint>"
        return meta

    monkeypatch.setattr(CkptWriter, "storage_meta", fixed)
    cache = plan_cache.PlanCache()

    def state(k):
        return {"model": {"w": torch.full((3, 4), float(k)), "b": torch.zeros(4)}, "step": k, "l": [torch.ones(2)]}

    first, second = (_save(tmp_path / f"c{k}", state(k), cache) for k in range(2))
    planned = _save(tmp_path / "planned", state(1), plan_cache.PlanCache())
    assert (first.plan_reused, second.plan_reused, planned.plan_reused) == (False, True, False)
    assert _metadata(tmp_path / "c1") == _metadata(tmp_path / "planned")
    for result in (first, second, planned):
        assert result.planning_seconds > 0 and result.global_plan_seconds >= 0
    loaded = {"model": {"w": torch.zeros(3, 4), "b": torch.ones(4)}, "step": 0, "l": [torch.zeros(2)]}
    ckptlib.load(tmp_path / "c1", loaded)
    assert torch.equal(loaded["model"]["w"], state(1)["model"]["w"]) and loaded["step"] == 1
