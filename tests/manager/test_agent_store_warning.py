"""A worker of torchrun's elastic agent whose default group uses the agent's store
(TORCHELASTIC_USE_AGENT_STORE=True: the c10d rendezvous's default, or a static one) with
restarts allowed is told so when its CheckpointManager is made: torch keys a gloo group's
addresses by rank only and that store keeps them from one attempt to the next, so restarted
workers can read the previous attempt's addresses ("Gloo connectFullMesh failed ... Connection
refused", tests/helpers/agent_store_repro.py) and spend --max-restarts. Once per process; not
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the workers' rank 0 hosts a fresh store each round),
nor without restarts, nor outside torchrun.

Before: nothing said it; the restarts failed in init_process_group with that message."""

from __future__ import annotations

import warnings

import pytest

import ckptlib
from ckptlib.manager import preemption

EXPECTED = (
    "torchrun's agent shares its store with the workers (TORCHELASTIC_USE_AGENT_STORE=True) and may "
    "restart them (--max-restarts 3): restarted workers can read the previous attempt's gloo "
    "addresses from it and fail in init_process_group ('Gloo connectFullMesh failed ... Connection "
    "refused'), spending restarts. With the c10d rendezvous set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on "
    "every agent (a fresh store each round); docs/tier.md"
)

CASES = {
    "shared-store-with-restarts": ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}, True),
    "fresh-store-per-round": ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}, False),
    "shared-store-no-restarts": ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
    "restarts-without-the-store-variable": ({"TORCHELASTIC_MAX_RESTARTS": "3"}, False),
    "not-under-torchrun": ({}, False),
}


@pytest.fixture
def agent_env(monkeypatch):
    """Set the agent's worker variables (others removed); the once-per-process flag reset."""
    monkeypatch.setattr(preemption, "_agent_store_warned", False)

    def apply(env: dict[str, str]) -> None:
        for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return apply


@pytest.mark.parametrize("env, warns", list(CASES.values()), ids=list(CASES))
def test_a_manager_under_an_agent_sharing_its_store_with_restarts_warns_once(tmp_path, agent_env, env, warns):
    agent_env(env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptlib.CheckpointManager(tmp_path / "a").close()
        ckptlib.CheckpointManager(tmp_path / "b").close()  # a second manager: said once per process
    said = [w for w in caught if issubclass(w.category, ckptlib.SharedAgentStoreWarning)]
    assert [str(w.message) for w in said] == ([EXPECTED] if warns else []), [str(w.message) for w in caught]
    if warns:
        assert said[0].filename == __file__  # pointed at the caller's line, not ckptlib's


@pytest.mark.parametrize("restarts", ["-1", "x", ""], ids=["negative", "not-a-number", "empty"])
def test_restarts_not_a_positive_count_say_nothing(agent_env, restarts):
    agent_env({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": restarts})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert preemption.check_agent_store() is False
