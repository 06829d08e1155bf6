"""`ckpt validate --spec`: the two examples prove themselves from the command line at world
sizes 1, 2, 3 and two layouts each; a spec that does not import or whose factory fails on one
rank exits 2 with that rank's traceback (local ranks, and torchrun on two nodes), never a hang;
and a two-node torchrun run (one launcher per node, 127.0.0.1) validates over S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers.torchrun import Nodes, torchrun_env

from ckptlib.testing.fakes.s3_server import s3_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAIN = "examples/elastic_spec.py"
HF = "examples/hf_causal_lm.py"


def _ckpt(*argv: str, timeout: float = 1100, env: dict | None = None) -> subprocess.CompletedProcess:
    """`ckpt ARGV` as a user runs it (a fresh interpreter in the repository)."""
    return subprocess.run(
        [sys.executable, "-m", "ckptlib.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _cells(doc: dict) -> dict:
    return {(c["save_layout"], c["save_ws"], c["load_layout"], c["load_ws"]): c for c in doc["cells"]}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 36 pairs each; ~1.5 min on a quiet 2-core machine, much more when it is shared
@pytest.mark.parametrize(
    "example,layouts",
    [(PLAIN, ("fsdp2", "ddp")), (HF, ("fsdp2", "tp"))],
    ids=["plain-two-optimizers", "hf-llama-tp"],
)
def test_example_validates_from_the_command_line(example, layouts):
    if example == HF and os.environ.get("CI") != "true":  # in CI a missing transformers fails the test
        pytest.importorskip("transformers", reason="pip install -e '.[test]' (or '.[examples]') brings transformers")
    argv = ["--spec", example, "--world-sizes", "1,2,3", "--layouts", ",".join(layouts), "--json", "--timeout", "1000"]
    done = _ckpt("validate", *argv)
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads(done.stdout)
    every = [(a, n, b, m) for a in layouts for n in (1, 2, 3) for b in layouts for m in (1, 2, 3)]
    assert sorted(_cells(doc)) == sorted(every)
    assert doc["ok"] is True and all(c["ok"] and c["error"] == "" for c in doc["cells"]), doc["cells"]
    assert doc["spec"] == os.path.join(REPO, example) and doc["layouts"] == list(layouts) and doc["wrap"] == "spec"


def test_the_spec_layouts_are_the_default_and_the_table_names_the_spec():
    done = _ckpt("validate", "--spec", PLAIN, "--world-sizes", "2", "--no-progress")
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"ckpt validate: root=(temporary directory on local disk) spec={REPO}/{PLAIN}")
    assert lines[1].split() == ["save\\load", "fsdp2@2", "ddp@2"] and lines[-1] == "all pairs passed"


FAILING = """
import torch
import torch.distributed as dist

def build_model(seed):
    torch.manual_seed(seed)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 has no weights for seed %d" % seed)
    return torch.nn.Linear(4, 3)

def loss(model, step):
    return model(torch.ones(2, 4) * step).square().mean()
"""


def test_a_factory_failing_on_one_rank_exits_2_with_its_traceback(tmp_path):
    spec = tmp_path / "failing_job.py"
    spec.write_text(textwrap.dedent(FAILING))
    done = _ckpt("validate", "--spec", str(spec), "--world-sizes", "1,2", "--layouts", "ddp", "--timeout", "120")
    assert done.returncode == 2, done.stderr[-4000:]
    err = done.stderr
    assert err.startswith("ckpt validate: error: rank 1: build_model(1) raised ValueError: rank 1 has no weights")
    assert "Traceback (most recent call last)" in err and f'File "{spec}", line 8, in build_model' in err
    assert done.stdout == ""


@pytest.mark.parametrize(
    "ref,message",
    [
        ("examples/elastic_spec.py:NOPE", "has no attribute 'NOPE'"),
        ("examples/absent.py", f"no such file {REPO}/examples/absent.py"),
        ("examples.train", "no build_model function"),
    ],
)
def test_bad_spec_references_exit_2(ref, message):
    done = _ckpt("validate", "--spec", ref, "--world-sizes", "1")
    assert done.returncode == 2 and message in done.stderr and done.stderr.startswith("ckpt validate: error: spec ")


# --------------------------------------------------------------------------- two torchrun nodes


def _two_nodes(argv: list[str], env: dict, logs) -> list[tuple[int, str, str]]:
    """One torchrun launcher per node (static rendezvous on 127.0.0.1), one rank each:
    [(exit code, stdout, stderr)] per node."""
    with Nodes.start(["-m", "ckptlib.cli", *argv], [1, 1], logs, env=env, split_stderr=True) as nodes:
        finished = nodes.wait(500)
    assert finished, f"the two nodes did not finish:\n{nodes.tails()}"
    return [(code, nodes.output(k), nodes.output(k, stderr=True)) for k, code in enumerate(nodes.returncodes())]


def _torchrun_env(moto_server: str) -> dict:
    env = torchrun_env()
    for key, value in s3_env(moto_server).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(600)
def test_spec_under_torchrun_on_two_nodes(s3_root, moto_server, tmp_path):
    """The ranks of two nodes share no directory: the checkpoints go to S3 (moto)."""
    argv = ["validate", "--spec", PLAIN, "--world-sizes", "1,2", "--root", s3_root, "--json", "--no-progress"]
    (rc0, out0, err0), (rc1, out1, err1) = _two_nodes(argv, _torchrun_env(moto_server), tmp_path / "nodes")
    assert rc0 == 0 and rc1 == 0, err0[-3000:] + err1[-3000:]
    doc = json.loads(out0)
    assert out1 == ""  # only rank 0 reports
    assert doc["ok"] and doc["root"] == s3_root and len(doc["cells"]) == 16  # (fsdp2, ddp) x (1, 2) squared


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(600)
def test_a_factory_failing_on_node_1_stops_both_nodes(s3_root, moto_server, tmp_path):
    spec = tmp_path / "failing_job.py"
    spec.write_text(textwrap.dedent(FAILING))
    argv = ["validate", "--spec", str(spec), "--world-sizes", "2", "--layouts", "ddp", "--root", s3_root]
    (rc0, _, err0), (rc1, _, err1) = _two_nodes(argv, _torchrun_env(moto_server), tmp_path / "nodes")
    assert rc0 != 0 and rc1 != 0
    for err in (err0, err1):  # rank 0 says it, and so does rank 1 (on node 1), where it started
        assert "ckpt validate: error: rank 1: build_model(0) raised ValueError: rank 1 has no weights" in err
    assert f'File "{spec}", line 8, in build_model' in err1
