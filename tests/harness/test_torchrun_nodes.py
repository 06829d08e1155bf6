"""The simulated-nodes helper (tests/helpers/torchrun.py) tells a finished job from a hung one:
a rank that aborts at teardown after its work (gloo does, about 1 run in 20) makes its launcher
fail and skip torchrun's exit barrier, and the other launcher would wait 300 s in that barrier
for it; `Nodes.wait` stops that launcher and leaves the judging to what the workers wrote."""

from __future__ import annotations

import signal

import pytest
from helpers.torchrun import LAUNCH_TIMEOUT, TESTS, Nodes

WORKER = str(TESTS / "helpers" / "teardown_abort.py")


# Node 1 failing leaves node 0 (the store's host) in the barrier until stopped; node 0 failing
# takes the store down and node 1's barrier ends by itself.
@pytest.mark.parametrize(
    ("aborting", "waiting_exit"),
    [(3, -signal.SIGKILL), (0, 0)],
    ids=["abort-rank3-node1", "abort-rank0-node0"],
)
def test_a_teardown_abort_on_one_node_does_not_hang_the_other(tmp_path, aborting, waiting_exit):
    out = tmp_path / "out"
    out.mkdir()
    with Nodes.start([WORKER, str(out), str(aborting)], [2, 2], tmp_path / "logs") as nodes:
        # well inside torchrun's 300 s exit barrier: only stopping the waiting launcher ends it
        finished = nodes.wait(LAUNCH_TIMEOUT / 2)
        codes = nodes.returncodes()
    assert finished, nodes.tails()
    assert sorted(p.name for p in out.iterdir()) == [f"rank{r}.done" for r in range(4)]
    assert all((out / f"rank{r}.done").read_text() == "4" for r in range(4))
    failed, waiting = (1, 0) if aborting >= 2 else (0, 1)
    assert codes[failed] not in (0, None), nodes.tails()
    assert codes[waiting] == waiting_exit, nodes.tails()
    assert "SIGABRT" in nodes.output(failed) or "Signal 6" in nodes.output(failed), nodes.tails()
