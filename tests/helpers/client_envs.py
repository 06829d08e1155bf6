"""Running scripts in the real client packages' environments (tests/clients/, issue 28).

The clients cannot live in the test venv: Composer pins torch<2.7.1 and torchtitan needs
triton. `ci/client_envs.sh` builds `.ci/clients/venv-hf` and `.ci/clients/venv-composer`
(or under $CKPTLIB_CLIENT_ENVS), each pinned by its constraints file in ci/; a script from
tests/helpers/client_scripts/ runs there with this checkout first on its path, alone or under
torchrun (gloo, CPU). Without an env a test skips and says how to build it; under CI=true
it fails instead (`.ci/run` builds them first).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ckptlib.testing.harness.ports import address_in_use, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "tests", "helpers", "client_scripts")
ENVS = {"hf": "transformers, Lightning, torchtitan (torch 2.13)", "composer": "MosaicML Composer (torch 2.7)"}
STAMP = ".ckptlib-client-env"
# What a gloo rank may print when it aborts in teardown after its work is done (GUIDE: ~1 in 20).
TEARDOWN_ABORT = "terminate called without an active exception"


def env_dir() -> str:
    return os.environ.get("CKPTLIB_CLIENT_ENVS") or os.path.join(REPO, ".ci", "clients")


def python(env: str) -> str:
    """The python of client env `env` ("hf" or "composer"); skip (fail under CI=true) without it."""
    root = os.path.join(env_dir(), f"venv-{env}")
    exe = os.path.join(root, "bin", "python")
    if not (os.path.isfile(exe) and os.path.isfile(os.path.join(root, STAMP))):
        message = (
            f"the {ENVS[env]} client environment {root} is not built; build it with: ci/client_envs.sh {env} "
            "(~3 min; or set CKPTLIB_CLIENT_ENVS to a directory holding it)"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return exe


def _environ(workdir: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([REPO, SCRIPTS]),
        PYTHONHASHSEED="0",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=os.path.join(workdir, "hf-home"),
        WANDB_MODE="disabled",
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
    )
    return env


def run(env: str, script: str, *args: str, nproc: int = 0, workdir: str, timeout: float = 600) -> list[dict]:
    """Run tests/helpers/client_scripts/`script` with `args` in client env `env`: in one process
    (`nproc=0`), or under torchrun with `nproc` ranks. Each process writes its result as JSON to
    `$CKPTLIB_RESULT_DIR/rank<r>.json` (`client_scripts/client_common.report`); returns them in rank
    order. A failed run fails the test with its output; a rank that aborted in gloo's teardown
    after reporting (see TEARDOWN_ABORT) does not."""
    exe = python(env)
    results = os.path.join(workdir, f"results-{script.removesuffix('.py')}-{free_port()}")
    os.makedirs(results)
    environ = _environ(workdir)
    environ["CKPTLIB_RESULT_DIR"] = results
    for _attempt in range(3):
        command = [exe, os.path.join(SCRIPTS, script), *args]
        if nproc:
            launcher = [exe, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
            launcher += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
            command = launcher + command[1:]
        try:
            proc = subprocess.run(
                command, cwd=workdir, env=environ, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{script} {' '.join(args)} timed out after {timeout}s:\n{exc.stdout}\n{exc.stderr}")
        # the launcher's port taken before it bound it (no rank ran): launch again on another
        if not (nproc and proc.returncode != 0 and not os.listdir(results) and address_in_use(proc.stderr)):
            break
    reports = sorted(f for f in os.listdir(results) if f.endswith(".json"))
    done = len(reports) == max(nproc, 1)
    if proc.returncode != 0 and not (done and TEARDOWN_ABORT in proc.stderr):
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-80:])
        pytest.fail(f"{script} {' '.join(args)} (nproc={nproc}) exited {proc.returncode}:\n{tail}", pytrace=False)
    assert done, f"{script}: {len(reports)} of {max(nproc, 1)} processes reported:\n{proc.stderr[-4000:]}"
    out = []
    for name in sorted(reports, key=lambda n: int(n[len("rank") : -len(".json")])):
        with open(os.path.join(results, name)) as f:
            out.append(json.load(f))
    return out


__all__ = ["REPO", "SCRIPTS", "env_dir", "python", "run"]
