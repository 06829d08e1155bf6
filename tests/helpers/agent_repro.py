"""Growing a torchrun elastic job, without ckptlib (torch's c10d agents, plain gloo workers):
the reproduction of why a node joining never completes the round (see ELASTIC_ENV in
helpers/torchrun.py). Imports nothing from ckptlib or tests/, so it runs on any torch.

    python tests/helpers/agent_repro.py loss|join OUTDIR [ENV=VALUE ...] [--launcher-flag ...]

`loss`: 2 agents x 2 workers, SIGKILL one agent's tree, then a third agent joins; `join`: 1
agent, then a second joins. Prints when each world size was reached; exits 1 if not grown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

CONF = "is_host=false,last_call_timeout=2,join_timeout=300,keep_alive_interval=2"


def worker(log: str) -> None:
    """all_reduce a ones tensor every 0.3 s, logging (restart, world, rank, sum) per step."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    for step in range(100000):
        t = torch.ones(1)
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            with open(log, "a") as f:
                f.write(f"restart={restart} world={dist.get_world_size()} sum={int(t.item())} step={step}\n")
        time.sleep(0.3)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and its descendants, found first (each worker is in a session of its own)."""
    kids: dict[int, list[int]] = {}
    for e in filter(str.isdigit, os.listdir("/proc")):
        try:
            kids.setdefault(int(Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(e))
        except (OSError, ValueError):
            continue
    todo = [proc.pid]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def main(mode: str, out: str, extra: list[str]) -> int:
    """Run scenario `mode` on a standalone rendezvous store; 0 if the job grew to world 4."""
    import torch.distributed as dist

    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    log = outdir / "steps.log"
    log.write_text("")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    env.update(kv.split("=", 1) for kv in extra if not kv.startswith("--"))
    flags = [kv for kv in extra if kv.startswith("--")]
    agents: list[subprocess.Popen] = []

    def start() -> None:
        k = len(agents)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1:2"]
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=repro"]
        cmd += [f"--rdzv-conf={CONF}", "--max-restarts=3", *flags, __file__, "--worker", str(log)]
        with open(outdir / f"agent{k}.log", "w") as f:
            agents.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        print(f"t={time.monotonic() - t0:6.1f} started agent{k} pid={agents[-1].pid}", flush=True)

    def wait_world(world: int, after: int, limit: float = 150) -> bool:
        """Wait until a step past line `after` of the log ran at `world` (False after `limit`)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            lines = log.read_text().splitlines()[after:]
            if any(f"world={world} sum={world} " in ln for ln in lines):
                print(f"t={time.monotonic() - t0:6.1f} world {world}: {lines[-1]}", flush=True)
                return True
            time.sleep(0.5)
        print(f"t={time.monotonic() - t0:6.1f} NO world {world}; agents exit {[a.poll() for a in agents]}")
        return False

    t0 = time.monotonic()
    try:
        start()
        if mode == "loss":
            start()
            ok = wait_world(4, 0)
            kill(agents[1])
            print(f"t={time.monotonic() - t0:6.1f} killed agent1", flush=True)
            ok = ok and wait_world(2, len(log.read_text().splitlines()))
        else:
            ok = wait_world(2, 0)
        mark = len(log.read_text().splitlines())
        start()
        ok = ok and wait_world(4, mark)
        print("RESULT", "grew to 4" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        for a in agents:
            kill(a)


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
