"""Simulated hosts on this machine: one torchrun launcher per host, as a cluster runs them.

`Nodes.start` starts them (a static rendezvous on `--node-rank`, or torchrun's elastic c10d
rendezvous on a store the caller hosts); `wait` collects them, `kill` is the loss of a host
(SIGKILL of its agent *and* every worker: torchrun starts each worker in a session of its own,
so the agent's process group misses them; `kill_tree` finds them in /proc), and leaving the
`with` block kills what is left. Each launcher's output goes to a file (no pipe to fill), read
back with `output(k)`. Shared by the tests (tests/helpers/torchrun.py) and `ckpt bench
recovery`, so it lives in the package; the standard library only, like the other harness modules."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from ckptlib.testing.harness.parent_death import preexec_die_with_parent
from ckptlib.testing.harness.ports import address_in_use, free_port

#: How long a whole launch may take before it counts as hung (a loaded 2-core machine
#: needs ~20-60 s for a torchrun launch, most of it importing torch).
LAUNCH_TIMEOUT = 300.0
#: How long a static job's launcher may wait without workers after another launcher failed
#: before `Nodes.wait` calls it stuck in torchrun's exit barrier.
BARRIER_GRACE = 20.0


def launcher_env(**extra: str) -> dict[str, str]:
    """The environment of a launcher: gloo on loopback, one OpenMP thread, no torchrun (or
    pytest) variables of an enclosing run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PYTEST_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc (whatever session or group each is in)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant, found before the first dies (an orphaned worker is
    re-parented to init and could no longer be found)."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (an exited child its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


#: The elastic agents' environment. torch's c10d rendezvous shares its TCPStore with the workers
#: by default and caches that store's address after a node's first round
#: (dynamic_rendezvous.py:1209, torch 2.13): a group rank 0 that already hosts one never
#: publishes MASTER_ADDR in a later round's prefix, so a joining node waits for it and the
#: rank 0 agent for the joiner's role_info until both time out (growth never completes); and
#: every restart's workers reuse the old store, reading the previous attempt's gloo addresses.
#: Not sharing it makes rank 0 publish a fresh address every round (dynamic_rendezvous.py:1194).
#: tests/helpers/agent_repro.py reproduces it without ckptlib.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_flags(elastic: tuple[str, str], rdzv_conf: dict[str, str] | None, run_id: str) -> list[str]:
    """torchrun's flags for a c10d rendezvous on the store at `elastic[0]`, `--nnodes elastic[1]`,
    `is_host=false` on every agent (the store is the cluster's, not an agent's) plus `rdzv_conf`."""
    endpoint, nnodes = elastic
    conf = ",".join(f"{k}={v}" for k, v in {"is_host": "false", **(rdzv_conf or {})}.items())
    return [
        f"--nnodes={nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-conf={conf}",
        f"--rdzv-id={run_id}",
    ]


def worker_with_rank(nodes: Nodes, rank: int) -> int | None:
    """The node whose worker has global RANK=`rank` now (from the workers' environments)."""
    for node in range(len(nodes.procs)):
        for pid in nodes.worker_pids(node):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            except OSError:
                continue
            if env.get(b"RANK") == str(rank).encode() and b"LOCAL_RANK" in env:
                return node
    return None


class Nodes:
    """Launchers of one job, node k's output in `<logs>/node<k>.log` (stderr apart with
    `split_stderr`, in `node<k>.err`). A subclass sets `cwd` (the launchers' directory),
    `default_env` (their environment when `start` gets none) and `run_prefix` (of the
    rendezvous id)."""

    cwd: str | os.PathLike | None = None
    run_prefix = "ckptlib-"

    @staticmethod
    def default_env() -> dict[str, str]:
        return launcher_env()

    def __init__(self, logs: Path, procs: list[subprocess.Popen], split_stderr: bool, elastic_args=None):
        self.logs = Path(logs)
        self.procs = procs
        self.split_stderr = split_stderr
        self._elastic_args = elastic_args  # how a node joins this job (`join`), if elastic

    # ------------------------------------------------------------------ start
    @classmethod
    def start(
        cls,
        target: Sequence[str] | Callable[[int], Sequence[str]],
        per_node: Sequence[int],
        logs: Path,
        *,
        env: dict[str, str] | None = None,
        env_by_node: dict[int, dict[str, str]] | None = None,
        split_stderr: bool = False,
        elastic: tuple[str, str] | None = None,
        rdzv_conf: dict[str, str] | None = None,
        max_restarts: int = 0,
        launcher_args: Sequence[str] = (),
    ) -> Nodes:
        """Start one launcher per entry of `per_node` (that many ranks on it) running `target`
        (a script and its arguments, or `-m module ...`; or a function of the node giving them).

        Static rendezvous (default): node k is `--node-rank k` of `len(per_node)`, node 0 hosts
        the store on a fresh port; a port taken before node 0 bound it is retried on another.
        `elastic=(endpoint, nnodes)`: torchrun's c10d rendezvous on a store the caller hosts at
        `endpoint` (`is_host=false` on every agent, as on a cluster with a stable endpoint, plus
        `rdzv_conf`), `--nnodes nnodes` (e.g. "1:2"), `--max-restarts max_restarts`; more
        nodes can `join` the running job then."""
        logs = Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        run_id = f"{cls.run_prefix}{uuid.uuid4().hex[:8]}"  # one job: its own rendezvous on a shared store
        for _attempt in range(3):
            port = free_port()
            procs = []
            for node, nproc in enumerate(per_node):
                node_env = dict(env if env is not None else cls.default_env())
                node_env.update((env_by_node or {}).get(node, {}))
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
                if elastic is None:
                    cmd += [f"--nnodes={len(per_node)}", f"--node-rank={node}", "--rdzv-backend=static"]
                    cmd += [f"--rdzv-endpoint=127.0.0.1:{port}", "--master-addr=127.0.0.1"]
                else:
                    cmd += elastic_flags(elastic, rdzv_conf, run_id)
                    node_env.update(ELASTIC_ENV)
                args = target(node) if callable(target) else target
                cmd += [f"--max-restarts={max_restarts}", *launcher_args, *args]
                procs.append(cls._popen(cmd, node_env, logs, node, split_stderr))
            elastic_args = None if elastic is None else (elastic, rdzv_conf, run_id, max_restarts, tuple(launcher_args))
            nodes = cls(logs, procs, split_stderr, elastic_args)
            if elastic is not None or not nodes._port_taken():
                return nodes
            nodes.kill_all()
        raise AssertionError(f"the rendezvous port was taken on 3 attempts:\n{nodes.tails()}")

    def join(self, args: Sequence[str], nproc: int, env: dict[str, str] | None = None) -> int:
        """Start one more node's launcher in this elastic job (a replacement host joining);
        returns its node index here."""
        assert self._elastic_args is not None, "only an elastic job can grow"
        elastic, rdzv_conf, run_id, max_restarts, launcher_args = self._elastic_args
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        cmd += elastic_flags(elastic, rdzv_conf, run_id)
        cmd += [f"--max-restarts={max_restarts}", *launcher_args, *args]
        node = len(self.procs)
        node_env = {**(env if env is not None else self.default_env()), **ELASTIC_ENV}
        self.procs.append(self._popen(cmd, node_env, self.logs, node, self.split_stderr))
        return node

    @classmethod
    def _popen(cls, cmd: list[str], env: dict[str, str], logs: Path, node: int, split: bool) -> subprocess.Popen:
        out = open(logs / f"node{node}.log", "w")  # noqa: SIM115 - the child holds it; closed below
        err = open(logs / f"node{node}.err", "w") if split else subprocess.STDOUT  # noqa: SIM115
        try:
            # the launcher ends with the test process (its workers, in sessions of their own, are
            # ended by `Nodes.close`, or when their agent's rendezvous store goes)
            return subprocess.Popen(
                cmd, env=env, cwd=cls.cwd, stdout=out, stderr=err, preexec_fn=preexec_die_with_parent()
            )
        finally:
            out.close()
            if split:
                err.close()

    def _port_taken(self) -> bool:
        """Whether node 0's launcher failed to bind the rendezvous port (it then exits at once,
        before any worker starts; waits for node 0 only while it has not started a worker)."""
        first = self.procs[0]
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while first.poll() is None and time.monotonic() < deadline:
            if len(process_tree(first.pid)) > 1:  # workers started: the store is up
                return False
            time.sleep(0.1)
        return first.poll() not in (None, 0) and address_in_use(self.output(0, stderr=True))

    # ------------------------------------------------------------------ collect
    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def wait(self, timeout: float = LAUNCH_TIMEOUT) -> bool:
        """Wait for every launcher to exit; kill the whole job if one is still running after
        `timeout` (returns False then).

        In a static job a launcher whose worker failed exits at once, skipping torchrun's exit
        barrier, and the others sit in that barrier for its 300 s (elastic/agent/server/api.py,
        `_invoke_run`) - a gloo abort at teardown of one finished rank would hang the caller.
        Once a launcher has failed, the others' workers are done and they are still there
        after `BARRIER_GRACE`, they are waiting for nobody: they are killed and the caller
        judges what the workers wrote."""
        deadline = time.monotonic() + timeout
        idle_since: dict[int, float] = {}
        while True:
            codes = self.returncodes()
            if all(code is not None for code in codes):
                return True
            if time.monotonic() >= deadline:
                self.kill_all()
                return False
            if self._elastic_args is None and any(code not in (None, 0) for code in codes):
                now = time.monotonic()
                for node, code in enumerate(codes):
                    if code is not None or self.worker_pids(node):
                        idle_since.pop(node, None)
                    elif now - idle_since.setdefault(node, now) >= BARRIER_GRACE:
                        self.kill(node)
            time.sleep(0.2)

    def returncodes(self) -> list[int | None]:
        return [proc.poll() for proc in self.procs]

    def kill(self, node: int) -> None:
        """The loss of node `node`: SIGKILL of its agent and every worker it started."""
        kill_tree(self.procs[node].pid)
        self.procs[node].wait()

    def kill_all(self) -> None:
        for node, proc in enumerate(self.procs):
            if proc.poll() is None or len(process_tree(proc.pid)) > 1:
                self.kill(node)

    def worker_pids(self, node: int) -> list[int]:
        """The pids of node `node`'s workers (the agent's descendants)."""
        return [p for p in process_tree(self.procs[node].pid) if p != self.procs[node].pid]

    # ------------------------------------------------------------------ output
    def output(self, node: int, stderr: bool = False) -> str:
        """Node `node`'s output so far (its stderr alone with `stderr` and `split_stderr`)."""
        name = f"node{node}.err" if stderr and self.split_stderr else f"node{node}.log"
        path = self.logs / name
        return path.read_text(errors="replace") if path.exists() else ""

    def tails(self, chars: int = 4000) -> str:
        """The end of every launcher's output, for a failure message."""
        parts = []
        for node in range(len(self.procs)):
            text = self.output(node) + (self.output(node, stderr=True) if self.split_stderr else "")
            parts.append(f"--- node {node} (exit {self.procs[node].poll()})\n{text[-chars:]}")
        return "\n".join(parts)
