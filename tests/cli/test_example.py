"""examples/train.py: crash, resume at another world size, and the loss curve continues exactly.

What "exactly" means here: bit-identical losses, compared with an uninterrupted run.
The example is built so that its results do not depend on the world size at all (data
of step s is a function of the seed and s; each rank computes per-sample gradients one
sample at a time; every rank sums all per-sample gradients in global sample order; see
the example's docstring). So the reference is one uninterrupted run, and a run that
crashes on 4 ranks and resumes on 2 (or 3, or 1) must reproduce its loss at every step,
bit for bit. `test_world_size_does_not_change_the_losses` checks that premise directly,
so a failure there points at the example's determinism, not at ckptlib.

torchrun is what users run, so the crash/resume test uses it (and is marked slow: two
torchrun launches cost ~20-50 s on a 2-core machine, mostly importing torch); the other
cases use the forkserver launcher, which runs the same `main()` in fresh ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.torchrun import kill_tree, process_tree

from ckptlib._torch import parallel
from ckptlib.testing import RankExited

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "examples", "train.py")
CRASH_EXIT = 17
TORCHRUN_TIMEOUT = 240


def _example():
    spec = importlib.util.spec_from_file_location("ckptlib_example_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_main(argv: list[str]) -> int:
    """Rank body for the launcher: the example's main() in an initialized process group."""
    return _example().main(argv)


def read_log(path) -> dict[int, float]:
    """step -> loss; a step logged twice (killed after logging, redone on resume) must agree."""
    out: dict[int, float] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            step, loss = rec["step"], rec["loss"]
            assert out.get(step, loss) == loss, f"step {step} logged twice with different losses"
            out[step] = loss
    return out


def args(root, log, steps: int, *extra: str) -> list[str]:
    return ["--root", str(root), "--log", str(log), "--steps", str(steps), "--save-every", "3", *extra]


def torchrun_cmd(nproc: int, argv: list[str], *launcher_args: str) -> list[str]:
    run_args = list(launcher_args) or ["--standalone"]
    argv = ["--loss-log" if a == "--log" else a for a in argv]  # torchrun claims a bare --log
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *run_args, TRAIN, *argv]


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GLOO_SOCKET_IFNAME"] = "lo"  # keep gloo on loopback
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def torchrun(nproc: int, argv: list[str], *launcher_args: str, timeout: float = TORCHRUN_TIMEOUT):
    return subprocess.run(
        torchrun_cmd(nproc, argv, *launcher_args),
        env=torchrun_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    """An uninterrupted 4-rank run of 12 steps: step -> loss."""
    from ckptlib.testing import launch

    tmp = tmp_path_factory.mktemp("example-ref")
    launch(4, run_main, args(tmp / "ckpt", tmp / "loss.jsonl", 12), timeout=180)
    losses = read_log(tmp / "loss.jsonl")
    assert sorted(losses) == list(range(1, 13))
    return losses


def test_world_size_does_not_change_the_losses(reference, tmp_path, dist_run):
    """The premise of the exact comparisons: 1, 2 and 3 ranks give the 4-rank losses bit for bit."""
    for n in (1, 2, 3):
        log = tmp_path / f"loss{n}.jsonl"
        dist_run(n, run_main, args(tmp_path / f"ckpt{n}", log, 6))
        got = read_log(log)
        assert got == {s: reference[s] for s in range(1, 7)}, f"{n} ranks"


@pytest.mark.slow
def test_torchrun_crash_on_4_resume_on_2(reference, tmp_path):
    """torchrun 4 ranks, os._exit on every rank right after step 6 is saved; torchrun 2
    ranks resume from step 6 and finish at 12. Every logged loss equals the uninterrupted run's."""
    root, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    first = torchrun(4, args(root, log, 12, "--crash-at-step", "6"))
    assert first.returncode != 0, f"the crash did not happen:\n{first.stdout}\n{first.stderr}"
    assert f"exitcode  : {CRASH_EXIT}" in first.stderr, first.stderr[-3000:]
    assert sorted(read_log(log)) == list(range(1, 7))
    assert sorted(os.listdir(root)) == ["latest", "step_0000000003", "step_0000000006"]

    second = torchrun(2, args(root, log, 12))
    assert second.returncode == 0, f"{second.stdout}\n{second.stderr[-5000:]}"
    assert "resumed from step 6" in second.stdout
    assert read_log(log) == reference


def test_crash_resume_across_world_sizes_with_the_launcher(reference, tmp_path, dist_run):
    """4 ranks crash after step 3, 3 ranks resume and crash after step 9, 1 rank finishes:
    the stitched loss curve is the uninterrupted one."""
    root, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    for n, crash in ((4, 3), (3, 9)):
        results = dist_run(n, run_main, args(root, log, 12, "--crash-at-step", str(crash)), return_exceptions=True)
        assert all(isinstance(r, RankExited) and r.exitcode == CRASH_EXIT for r in results), results
        assert max(read_log(log)) == crash
    assert dist_run(1, run_main, args(root, log, 12)) == [0]
    assert read_log(log) == reference
    assert sorted(os.listdir(root)) == ["latest", "step_0000000009", "step_0000000012"]  # --keep 2


def test_finished_run_is_not_retrained(reference, tmp_path, dist_run):
    """Resuming a run that already reached --steps trains nothing and logs nothing."""
    root, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    dist_run(2, run_main, args(root, log, 6))
    before = open(log).read()
    dist_run(2, run_main, args(root, log, 6))
    assert open(log).read() == before
    assert read_log(log) == {s: reference[s] for s in range(1, 7)}


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(reference, tmp_path, dist_run):
    """SIGKILL torchrun and all its workers at an arbitrary moment (possibly inside a save),
    then resume on 2 ranks: uncommitted debris is skipped and the curve is exact."""
    root, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    proc = subprocess.Popen(
        torchrun_cmd(4, args(root, log, 12, "--step-delay", "0.25")),
        env=torchrun_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TORCHRUN_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and len(open(log).read().splitlines()) >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        kill_tree(proc.pid)
    finally:
        kill_tree(proc.pid)
        proc.wait(30)
    killed_at = max(read_log(log))
    assert 5 <= killed_at < 12
    assert dist_run(2, run_main, args(root, log, 12)) == [0, 0]
    assert read_log(log) == reference


def worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=`rank` (from its environment)."""
    for pid in process_tree(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"LOCAL_RANK" in env and pid != launcher_pid:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def wait_for_steps(proc, log, n: int) -> None:
    deadline = time.monotonic() + TORCHRUN_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and len(open(log).read().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or hung before logging {n} steps (exit {proc.poll()})")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank2"])
def test_torchrun_sigterm_saves_the_step_reached_then_resumes_on_2(reference, tmp_path, target):
    """SIGTERM mid-training, to torchrun (which forwards it to every worker) or to one of its 4
    workers: at the next maybe_save every rank saves the step it reached and exits 0. That
    step is committed and `latest` names it; torchrun on 2 ranks resumes from it and the
    stitched loss curve equals the uninterrupted run's."""
    root, log = tmp_path / "ckpt", tmp_path / "loss.jsonl"
    proc = subprocess.Popen(
        torchrun_cmd(4, args(root, log, 12, "--step-delay", "0.3")),
        env=torchrun_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_steps(proc, log, 4)
        os.kill(proc.pid if target == "launcher" else worker_pid(proc.pid, 2), signal.SIGTERM)
        out, err = proc.communicate(timeout=TORCHRUN_TIMEOUT)
    finally:
        kill_tree(proc.pid)
        proc.wait(30)
    reached = max(read_log(log))
    assert 4 <= reached < 12, (out, err[-3000:])
    assert f"SIGTERM received; saved step {reached}, exiting" in out, (out, err[-3000:])
    if target == "rank2":
        assert proc.returncode == 0, err[-3000:]  # every worker exited 0 after the save
    else:
        assert "exitcode  : -" not in err and "SIGKILL" not in err, err[-3000:]  # no worker was killed
        # torchrun itself was signalled: it re-raises SignalException and exits 1 (examples/README.md)
        assert proc.returncode == 1 and "SignalException" in err, (proc.returncode, err[-3000:])
    saved = [s for s in range(3, reached, 3)] + [reached]
    assert sorted(os.listdir(root)) == ["latest"] + [f"step_{s:010d}" for s in saved[-2:]]  # --keep 2
    assert os.readlink(root / "latest") == f"step_{reached:010d}"
    assert (root / f"step_{reached:010d}" / "ckptlib.json").exists()

    second = torchrun(2, args(root, log, 12))
    assert second.returncode == 0, f"{second.stdout}\n{second.stderr[-5000:]}"
    assert f"resumed from step {reached}" in second.stdout
    assert read_log(log) == reference


def fsdp2_step() -> str:
    """Rank body: one FSDP2 training step on CPU; 'ok' or the error text."""
    import torch
    import torch.distributed as dist

    try:
        fully_shard = parallel.fully_shard_fn()
        if fully_shard is None:
            return "no fully_shard"
        mesh = parallel.init_device_mesh_fn()("cpu", (dist.get_world_size(),))
        model = fully_shard(torch.nn.Linear(8, 4), mesh=mesh)
        model(torch.randn(2, 8)).sum().backward()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the text is the result
        return f"{type(exc).__name__}: {exc}"


def test_fsdp2_probe_matches_reality(dist_run):
    """parallel.fsdp2_cpu_reason() (which picks FSDP2 or the DDP fallback) predicts whether
    FSDP2 actually trains on CPU with this torch: on 2.6 it must fail with record_event."""
    outcomes = dist_run(2, fsdp2_step)
    reason = parallel.fsdp2_cpu_reason()
    assert _example().fsdp2_trains_on_cpu() == (reason is None)  # the example's own check agrees
    if reason is None:
        assert outcomes == ["ok", "ok"]
    else:
        assert all(o != "ok" for o in outcomes), f"probe says unsupported ({reason}) but FSDP2 trained"
        if parallel.fully_shard_fn() is not None:
            assert any("record_event" in o for o in outcomes), outcomes


def test_examples_import_only_public_ckptlib_names():
    """A user copies an example: every `ckptlib` module and name it imports is public (no `_`
    component). Before: examples/train.py imported `ckptlib._torch.parallel`."""
    import ast

    private = []
    for path in sorted(Path(REPO, "examples").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ckptlib":
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "ckptlib"]
            else:
                continue
            private += [f"{path.name}: {n}" for n in names if any(p.startswith("_") for p in n.split("."))]
    assert private == []
