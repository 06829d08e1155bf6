"""The cluster tier on two real torchrun nodes (one launcher per node, static rendezvous on
127.0.0.1), each node with its own local root, and a remote on S3 (moto) or a local directory.

The scenario: save step 1 (replicated, uploaded), then step 2, and kill -9 every process of
node 1 while its upload of step 2 hangs (a FaultProxy between node 1 and moto stalls it; with
the directory remote, node 1's uploads are held in the worker); node 0 gets an
UploadRankLostError, the remote `latest` stays at step 1. Then node 1's root is wiped, and the
job resumes step 2 bit for bit at 3 ranks (one node of 3; and 2+1, the new node 1 empty) and
at 4, reading nothing from the remote (the replicas: `replicas=1`). Every worker runs under an
audit hook that refuses and records any file operation under another node's root (with a
negative control showing that the hook catches one), and is judged by the result file it
writes, not by its exit code (gloo can abort at teardown)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers.torchrun import LAUNCH_TIMEOUT, TESTS, Nodes

WORKER = str(TESTS / "helpers" / "cluster_worker.py")


class Cluster:
    """Simulated nodes on this machine: node k's root is `<tmp>/node{k}`."""

    def __init__(self, tmp, remote: str, replicas: int):
        self.tmp = tmp
        self.remote = remote
        self.replicas = replicas
        self.audit = tmp / "audit"
        self.audit.mkdir()

    def root(self, node: int) -> str:
        return str(self.tmp / f"node{node}")

    def launch(self, phase: str, per_node: list[int], out, *, env_by_node=None, extra=()) -> Nodes:
        """One torchrun launcher per node (`per_node[k]` ranks on node k)."""
        by_node = {}
        for node in range(len(per_node)):
            env = {"CKPTLIB_S3_MAX_ATTEMPTS": "2", "CKPT_AUDIT": str(self.audit / f"{phase}-node{node}")}
            env["CKPT_FORBIDDEN"] = os.pathsep.join(self.root(k) for k in range(2) if k != node)
            env.update((env_by_node or {}).get(node, {}))
            by_node[node] = env

        def target(node: int) -> list[str]:
            return [WORKER, phase, "--local-root", self.root(node), "--out", str(out), "--remote", self.remote]

        extra = ["--replicas", str(self.replicas), *extra]
        return Nodes.start(lambda node: target(node) + extra, per_node, out, env_by_node=by_node)

    def results(self, phase: str, out, world: int, nodes: Nodes | None = None) -> list[dict]:
        found = []
        for rank in range(world):
            path = out / f"{phase}.rank{rank}.json"
            assert path.exists(), f"rank {rank} wrote no result:\n{nodes.tails() if nodes else ''}"
            found.append(json.loads(path.read_text()))
        return found

    def run(self, phase: str, per_node: list[int], name: str, **kwargs) -> list[dict]:
        out = self.tmp / name
        out.mkdir()
        with self.launch(phase, per_node, out, **kwargs) as nodes:
            nodes.wait()
            return self.results(phase, out, sum(per_node), nodes)

    def violations(self) -> list[str]:
        return [line for f in sorted(self.audit.iterdir()) for line in f.read_text().splitlines()]


def _wait_for(predicate, what: str, nodes: Nodes, timeout: float = LAUNCH_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{nodes.tails()}")
        time.sleep(0.1)


def _pointer(remote: str) -> str | None:
    from ckptlib.storage import open_storage

    return open_storage(remote).read_pointer("latest")


@pytest.fixture(params=["s3", "dir"])
def remote_kind(request):
    return request.param


@pytest.mark.slow
@pytest.mark.timeout(900)  # four launches (~20-60 s each, more on a loaded machine)
def test_kill_one_node_mid_upload_then_resume_at_3_and_4(tmp_path, remote_kind, request):
    if remote_kind == "s3":
        from ckptlib.testing.fakes.faultproxy import FaultProxy

        endpoint = request.getfixturevalue("s3_server")
        remote = request.getfixturevalue("s3_root")
        proxy = FaultProxy(int(endpoint.rsplit(":", 1)[1]))
        request.addfinalizer(proxy.close)
        node1_env = {"AWS_ENDPOINT_URL": proxy.endpoint, "AWS_ENDPOINT_URL_S3": proxy.endpoint}
    else:
        remote = str(tmp_path / "remote")
        proxy = None
        node1_env = {"CKPT_TEST_HOLD_UPLOADS": str(tmp_path / "held")}
        (tmp_path / "held").mkdir()
    cluster = Cluster(tmp_path, remote, replicas=1)

    # -- save 1 and 2 on 2x2; node 1 is killed while its upload of step 2 hangs ----------
    out = tmp_path / "save"
    out.mkdir()
    with cluster.launch("save", [2, 2], out, env_by_node={1: node1_env}, extra=["--steps", "1,2"]) as nodes:
        _wait_for(lambda: all((out / f"ready.rank{r}").exists() for r in range(4)), "step 1 on every rank", nodes)
        assert _pointer(remote) == "step_0000000001"
        if proxy is not None:
            proxy.stall_after(0)
        (out / "go").touch()
        if proxy is not None:
            _wait_for(proxy.stalled.is_set, "node 1's upload to stall", nodes)
        else:
            _wait_for(lambda: len(os.listdir(tmp_path / "held")) == 2, "node 1's uploads to hang", nodes)
        nodes.kill(1)
        # node 0's ranks fail (UploadRankLostError) and write their results; its agent would
        # then wait out torchrun's exit barrier for the dead agent (300 s): stopped here instead
        _wait_for(lambda: all((out / f"save.rank{r}.json").exists() for r in (0, 1)), "node 0's results", nodes)
    survivors = cluster.results("save", out, 2)
    for res in survivors:
        assert not res["ok"], res
        assert {"UploadRankLostError", "UploadError", "RankLostError"} <= set(res["error"]["types"]), res["error"]
        assert set(res["error"]["ranks"]) == {2, 3}, res["error"]
        assert res["uploads"] == [1]
    assert _pointer(remote) == "step_0000000001"  # the remote latest never named the partial step 2
    for node in (0, 1):
        assert sorted(os.listdir(os.path.join(cluster.root(node), "step_0000000002"))) == [
            ".metadata",
            *[f"__{r}_0.distcp" for r in range(4)],
            "ckptlib.json",
        ], f"node {node}: own files and the partner's replicas"
    if proxy is not None:
        proxy.restore()

    # -- node 1's disk is lost; resume on one node of 3, on 2+1, on 2x2 ------------------
    shutil.rmtree(cluster.root(1))
    for name, per_node in (("resume-1x3", [3]), ("resume-2+1", [2, 1]), ("resume-2x2", [2, 2])):
        results = cluster.run("resume", per_node, name)
        for res in results:
            assert res["ok"], (name, res)
            assert res["resumed"] == 2 and res["problems"] == [], (name, res)
            assert res["bytes_by_source"]["remote"] == 0, (name, res["bytes_by_source"])
            assert res["bytes_by_source"]["local"] > 0, (name, res["bytes_by_source"])
            assert res["uploaded"] in (2, None) and res["latest"] == 2, (name, res)
        if name == "resume-2+1":
            assert results[2]["bytes_received"], "the new node's rank received its items from node 0"
        assert _pointer(remote) == "step_0000000002"  # the first resume uploaded the step it resumed
    assert cluster.violations() == []


def test_the_audit_hook_catches_a_rank_touching_another_root(tmp_path):
    """Negative control: the hook the workers run under does refuse and record."""
    other = tmp_path / "node1"
    other.mkdir()
    (other / "x").write_text("x")
    record = tmp_path / "audit"
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS / 'helpers')!r}); import cluster_worker as w; "
        f"w.install_audit_hook([{str(other)!r}], {str(record)!r});\n"
        "import os\n"
        "for fn in (lambda: open(os.path.join(sys.argv[1], 'x')), lambda: os.listdir(sys.argv[1]),\n"
        "           lambda: os.remove(os.path.join(sys.argv[1], 'x'))):\n"
        "    try:\n        fn()\n    except PermissionError:\n        print('refused')\n"
        "open(os.path.join(sys.argv[2], 'mine'), 'w').close()\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(other), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused"] * 3
    lines = record.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["open", "os.listdir", "os.remove"]
    assert all(str(other) in line for line in lines)
    assert (other / "x").exists() and (tmp_path / "mine").exists()
