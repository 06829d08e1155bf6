"""Restarts under torchrun's elastic agent that share the agent's store, without ckptlib: why a
restarted worker fails in init_process_group with "Gloo connectFullMesh failed ... timed out
connecting: SO_ERROR: Connection refused" (ckptlib warns: SharedAgentStoreWarning). Imports
nothing from ckptlib or tests/, so it runs on any torch.

    python tests/helpers/agent_store_repro.py shared|fresh [ATTEMPTS]

One agent (c10d rendezvous on a standalone store, `--nnodes 1:2`, `--max-restarts ATTEMPTS-1`,
default 4 attempts) runs 2 gloo workers; each attempt's workers init, all_reduce and exit 3 so the
agent restarts them, the last exits 0; which rank reaches the store first alternates.
`shared`: torch 2.13's default, the agent's store outlives every attempt and still holds the
previous attempt's gloo addresses (keyed by rank only), so a restarted rank that reads its peer's
key before the peer rewrote it dials a dead process. `fresh`: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
rank 0 hosts a new store on a new port each round. Prints each attempt's outcome; exits 1 if an
attempt failed. Measured with torch 2.13 on the loaded 2-core machine (2026-12-07): shared, 2 of 4
attempts ran (attempts 1 and 3 failed with the message above, then the agent gave up, exit 1);
fresh, 4 of 4 ran, each on a new MASTER_PORT.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time


def worker() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    time.sleep(2.0 if (rank + restart) % 2 else 0.0)  # alternate the rank that reads the store first
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1))
    print(f"attempt {restart}: rank {rank} ran (MASTER_PORT {os.environ['MASTER_PORT']})", flush=True)
    dist.barrier()
    if restart < int(os.environ["TORCHELASTIC_MAX_RESTARTS"]):
        sys.exit(3)  # ask the agent for another attempt


def main(mode: str, attempts: int) -> int:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if mode == "fresh":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1:2"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=repro"]
    cmd += ["--rdzv-conf=is_host=false,last_call_timeout=1", f"--max-restarts={attempts - 1}", __file__, "--worker"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    failed = 0
    for attempt in range(attempts):
        ran = sorted(set(re.findall(rf"attempt {attempt}: rank (\d) ran", text)))
        print(f"{mode}: attempt {attempt}: " + ("both ranks ran" if ran == ["0", "1"] else f"ranks ran: {ran}"))
        failed += ran != ["0", "1"]
    for line in sorted(set(re.findall(r"RuntimeError: Gloo connectFullMesh failed with .*", text))):
        print("  ", line[:200])
    print(f"{mode}: {attempts - failed} of {attempts} attempts ran; agent exit {out.returncode}")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker()
    else:
        sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4))
