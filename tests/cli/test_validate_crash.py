"""`ckpt validate --crash REF`: the crash harness for any checkpointer from the command line
(ckptlib.testing.crash_check; the harness itself is tested in tests/harness/test_crash_check.py)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from ckptlib import cli


class LatestBeforeOptimizer:
    """Moves `latest` after the model's file and before the optimizer's; a missing optimizer
    file loads as a fresh optimizer."""

    def save(self, root, step, state):
        rank = dist.get_rank()
        folder = os.path.join(root, f"step_{step}")
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        dist.barrier()
        torch.save(state["model"].state_dict(), os.path.join(folder, f"model{rank}.pt"))
        dist.barrier()
        if rank == 0:
            with open(os.path.join(root, "latest"), "w") as f:
                f.write(str(step))
        dist.barrier()
        torch.save(state["optim"].state_dict(), os.path.join(folder, f"optim{rank}.pt"))
        dist.barrier()

    def load(self, root, state):
        pointer = os.path.join(root, "latest")
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            step = int(f.read())
        folder = os.path.join(root, f"step_{step}")
        rank = dist.get_rank()
        state["model"].load_state_dict(torch.load(os.path.join(folder, f"model{rank}.pt")))
        if os.path.exists(os.path.join(folder, f"optim{rank}.pt")):
            state["optim"].load_state_dict(torch.load(os.path.join(folder, f"optim{rank}.pt")))
        return step


REF = f"{__name__}:LatestBeforeOptimizer"


def test_validate_crash_reports_the_violation_and_exits_1(tmp_path, capsys):
    rc = cli.main(["validate", "--crash", REF, "--world-sizes", "2", "--root", str(tmp_path), "--crash-points", "0#6"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert (
        "VIOLATION rank 0 killed at #6 torch-save-open step_2/optim0.pt: the load resumed step 2, which is not "
        "step 2's state bit-exactly (a half-written step): rank 0: optim.state.0.step: values differ"
    ) in out
    assert out.rstrip().endswith("NOT CRASH CONSISTENT")
    assert (
        f"  print(crash_check('{REF}', world_size=2, root={str(tmp_path)!r}, wrap='plain', optim='adamw', "
        "points=['0#6'], victims=('one',)).text())"
    ) in out
    assert os.listdir(tmp_path) == []  # its roots are removed afterwards


def test_validate_crash_json(capsys):
    rc = cli.main(["validate", "--crash", REF, "--world-sizes", "2", "--crash-points", "0#0", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["ok"] is True and doc["world_size"] == 2
    assert [(c["point"], c["victims"], c["outcome"]) for c in doc["cases"]] == [
        ("0#0", "one", "resumed-1"),
        ("0#0", "all", "resumed-1"),
    ]
    assert doc["boundaries"]["0"][0] == {"rank": 0, "index": 0, "kind": "mkdir", "path": "step_2"}


def test_validate_crash_refuses_what_names_no_checkpointer(capsys):
    assert cli.main(["validate", "--crash", "no_such_module_xyz:Thing", "--world-sizes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt validate: error: checkpointer 'no_such_module_xyz:Thing': cannot import")
    assert cli.main(["validate", "--crash", "--world-sizes", "2"]) == 2
    assert capsys.readouterr().err == "ckpt validate: error: --crash needs a checkpointer: --crash pkg.module:attr\n"
