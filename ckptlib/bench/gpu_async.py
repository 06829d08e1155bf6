"""Async saves of a GPU training loop's state, side by side in one run: how long each method
blocks the loop (seconds per GB of state) and how much slower the steps are while it saves,
against DCP's own process checkpointer with pinned memory (issue 35 item 4).

One process, one GPU, a process group of one rank (gloo on 127.0.0.1: DCP's async save needs a
CPU backend, and its process checkpointer a group). The state is `--mib` MiB of float32 CUDA
tensors: the weights of a `--width` x `--width` tanh MLP, trained with SGD on a (`--batch`,
`--width`) activation, so a step is matmuls on the GPU (the host only launches kernels and waits
at the step's end). Methods, each repetition running them in a rotating order:

- `none`: `--steps` steps without a save;
- `thread`: `ckptlib.async_save(..., async_mode="thread")` (staged in plain host memory);
- `process`: `async_mode="process"` (staged in pinned shared memory, written by the writer process);
- `process_bg`: `"process"` with `background_staging=True`: the call returns before the
  device-to-host copy, the loop runs the step's forward and backward, then `handle.wait_staged()`
  and `optimizer.step()`;
- `dcp_process_pinned`: `torch.distributed.checkpoint.async_save(...,
  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=DefaultStager(StagingOptions(
  True, True, True, True)))`: pinned shared-memory staging on a side stream, written by DCP's
  checkpoint process; its staging future is waited for where `process_bg` calls `wait_staged()`.

A save method saves at the first step of its window and steps until the save has committed
(at least `--steps` steps). Blocking: the time in the save call plus the wait for the staging
copy before `optimizer.step()`, in seconds per GB (1e9 bytes) of state. Step slowdown: the mean
step of the window over the mean step of `none` in the same repetition. Both are medians over
`--reps` repetitions; one untimed window per method first starts the writer processes and fills
the staging buffers (the steady state of a training run). Before each save the state is cloned
on the device (outside the timed steps); the last checkpoint of every method is loaded back
onto the CPU and compared with that clone bit for bit (exit status 1 if any differs).

Without CUDA it exits with status 2 and says so (it never prints numbers it did not measure).
`--device cpu` is a dry run of the same code path on the CPU (DCP's stager then without pinned
memory, side stream or non-blocking copies, which need an accelerator): it proves the script
works end to end, its numbers are not GPU numbers.

Run: python -m ckptlib.bench.gpu_async [--mib 1024] [--reps 3] [--steps 20] [--width W] [--batch B]
                                       [--device cuda|cpu] [--json OUT] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from ckptlib.bench import counted, help_description

METHODS = ("none", "thread", "process", "process_bg", "dcp_process_pinned")
GB = 1e9
MiB = 1 << 20
NO_CUDA_EXIT = 2
DEFAULTS = {"cuda": {"width": 1024, "batch": 1024}, "cpu": {"width": 256, "batch": 64}}


def _log(msg: str) -> None:
    print(f"[bench gpu_async {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def no_cuda_reason() -> str | None:
    """Why the GPU run cannot happen here (None: it can)."""
    if torch.cuda.is_available():
        return None
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
    return f"CUDA is not available (torch {torch.__version__}, built with {built})"


def dcp_process_api() -> tuple[Any, Any, Any] | str:
    """(AsyncCheckpointerType, DefaultStager, StagingOptions) of this torch, or why it has none
    (DCP's process checkpointer and its stager are newer than some supported torch versions)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError as exc:
        return f"torch {torch.__version__} has no DCP process checkpointer with a DefaultStager ({exc})"
    return AsyncCheckpointerType, DefaultStager, StagingOptions


# --------------------------------------------------------------------------- the training loop


class Trainer:
    """The tanh MLP whose weights are the state: `step(before_update)` runs forward and backward,
    calls `before_update()` (the wait for a staging copy), then the SGD update, and returns the
    step's wall time (the device synchronised at its end)."""

    def __init__(self, device: torch.device, state_bytes: int, width: int, batch: int):
        self.device = device
        layers = max(1, round(state_bytes / (width * width * 4)))
        gen = torch.Generator().manual_seed(0)
        self.weights = [
            (torch.randn(width, width, generator=gen) / width**0.5).to(device).requires_grad_() for _ in range(layers)
        ]
        self.x = torch.randn(batch, width, generator=gen).to(device)
        self.optimizer = torch.optim.SGD(self.weights, lr=1e-3)
        self.step_no = 0

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def state(self) -> dict[str, Any]:
        return {"model": {f"w{i}": w for i, w in enumerate(self.weights)}, "step": self.step_no}

    def clone(self) -> dict[str, torch.Tensor]:
        self.sync()
        copy = {f"w{i}": w.detach().clone() for i, w in enumerate(self.weights)}
        self.sync()
        return copy

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, before_update=None) -> float:
        started = time.perf_counter()
        y = self.x
        for w in self.weights:
            y = torch.tanh(y @ w)
        y.square().mean().backward()
        if before_update is not None:
            before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sync()
        self.step_no += 1
        return time.perf_counter() - started


# --------------------------------------------------------------------------- the save methods


class Save:
    """One method's save in flight: `wait_staged()` before the update, `done()`, `finish()`
    (the failure raised, the time to the commit returned) and `load_into(state)`."""

    def __init__(self, method: str, path: str, state: dict[str, Any], stager=None, api=None):
        self.method, self.path = method, path
        self.started = time.perf_counter()
        self.committed_at: float | None = None
        if method == "dcp_process_pinned":
            import torch.distributed.checkpoint as dcp

            checkpointer_type = api[0]
            response = dcp.async_save(
                state, checkpoint_id=path, async_checkpointer_type=checkpointer_type.PROCESS, async_stager=stager
            )
            self.staging = getattr(response, "staging_completion", None)  # None: staged in the call
            self.upload = getattr(response, "upload_completion", response)
            self.upload.add_done_callback(lambda _: setattr(self, "committed_at", time.perf_counter()))
        else:
            import ckptlib

            mode = "thread" if method == "thread" else "process"
            self.handle = ckptlib.async_save(
                path, state, step=state["step"], async_mode=mode, background_staging=method == "process_bg"
            )
        self.call_s = time.perf_counter() - self.started
        self.wait_s = 0.0

    def wait_staged(self) -> None:
        started = time.perf_counter()
        if self.method == "dcp_process_pinned":
            if self.staging is not None:
                self.staging.result()
        else:
            self.handle.wait_staged()
        self.wait_s += time.perf_counter() - started

    def done(self) -> bool:
        return self.upload.done() if self.method == "dcp_process_pinned" else self.handle.done()

    def finish(self) -> float:
        if self.method == "dcp_process_pinned":
            self.upload.result()
            return (self.committed_at or time.perf_counter()) - self.started
        return self.handle.wait().seconds

    def load_into(self, state: dict[str, Any]) -> None:
        if self.method == "dcp_process_pinned":
            import torch.distributed.checkpoint as dcp

            dcp.load(state, checkpoint_id=self.path)
        else:
            import ckptlib

            ckptlib.load(self.path, state)


def _differences(expected: dict[str, torch.Tensor], save: Save, step: int) -> list[str]:
    """How the checkpoint `save` wrote differs from `expected` (the clone at save time), loaded onto the CPU."""
    got = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in expected.items()}, "step": -1}
    save.load_into(got)
    found = [f"{k}: differs" for k, v in expected.items() if not torch.equal(got["model"][k], v.cpu())]
    if got["step"] != step:
        found.append(f"step {got['step']}, expected {step}")
    return found


def window(trainer: Trainer, method: str, args, scratch: str, tag: str, stager, api) -> dict[str, Any]:
    """One method's steps: `--steps` without a save, or a save at the first step and steps until
    it committed (at least `--steps`); the checkpoint is compared with the state at save time."""
    if method == "none":
        return {"steps": [trainer.step() for _ in range(args.steps)]}
    expected, step = trainer.clone(), trainer.step_no
    path = os.path.join(scratch, f"{method}-{tag}")
    save = Save(method, path, trainer.state(), stager, api)
    steps = [save.call_s + trainer.step(save.wait_staged)]  # the save call is part of its step
    while len(steps) < args.steps or not save.done():
        steps.append(trainer.step())
    commit_s = save.finish()
    problems = _differences(expected, save, step)
    shutil.rmtree(path, ignore_errors=True)
    return {
        "steps": steps,
        "blocking": save.call_s + save.wait_s,
        "call": save.call_s,
        "wait_staged": save.wait_s,
        "commit": commit_s,
        "problems": problems,
    }


def _init_group() -> None:
    import torch.distributed as dist

    from ckptlib.testing.harness.ports import free_port

    os.environ["MASTER_ADDR"] = "127.0.0.1"  # DCP's checkpoint process joins a store there
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)


def _stager(device: torch.device, api):
    """DCP's stager as torchtitan's fastest mode makes it: pinned shared memory, staged on a side
    stream with non-blocking copies; on the CPU (a dry run) shared memory only."""
    if isinstance(api, str):
        return None, None
    gpu = device.type == "cuda"
    options = api[2](gpu, True, gpu, gpu)
    return api[1](options), {
        "use_pinned_memory": options.use_pinned_memory,
        "use_shared_memory": options.use_shared_memory,
        "use_async_staging": options.use_async_staging,
        "use_non_blocking_copy": options.use_non_blocking_copy,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from ckptlib.saving import background_save, writer_process

    device = torch.device(args.device)
    _init_group()
    api = dcp_process_api()
    methods = [m for m in METHODS if not (m == "dcp_process_pinned" and isinstance(api, str))]
    stager, staging_options = _stager(device, api)
    trainer = Trainer(device, args.mib * MiB, args.width, args.batch)
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-gpu-async-", dir=args.dir)
    report: dict[str, Any] = {
        "command": "python -m ckptlib.bench.gpu_async " + " ".join(args.argv),
        "args": {k: getattr(args, k) for k in ("device", "mib", "reps", "steps", "width", "batch")},
        "machine": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
            "cpus": os.cpu_count(),
        },
        "state_bytes": trainer.nbytes,
        "tensors": len(trainer.weights),
        "dcp_unavailable": api if isinstance(api, str) else None,
        "dcp_staging_options": staging_options,
        "reps": [],
    }
    try:
        for method in methods:  # warm-up: writer processes started, staging buffers filled
            _log(f"warm-up {method}")
            window(trainer, method, args, scratch, "warm", stager, api)
        for rep in range(args.reps):
            order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
            _log(f"repetition {rep + 1}/{args.reps}: {', '.join(order)}")
            report["reps"].append(
                {"order": order, "runs": {m: window(trainer, m, args, scratch, str(rep), stager, api) for m in order}}
            )
        writer = writer_process.current()
        segments = list(writer.arena.segments.values()) if writer is not None else []
        report["ckptlib_staging_pinned"] = bool(segments) and all(s.pinned for s in segments)
    finally:
        if stager is not None:
            stager.close()
        background_save.release_staging()
        shutil.rmtree(scratch, ignore_errors=True)
        dist.destroy_process_group()
    report["ok"] = all(not r["runs"][m].get("problems") for r in report["reps"] for m in r["runs"])
    return report


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: medians over the repetitions; the bit-exact flag of its last checkpoint."""
    gb = report["state_bytes"] / GB
    rows = []
    for method in METHODS:
        runs = [rep["runs"][method] for rep in report["reps"] if method in rep["runs"]]
        if not runs:
            continue
        nones = [statistics.fmean(rep["runs"]["none"]["steps"]) for rep in report["reps"] if method in rep["runs"]]
        row: dict[str, Any] = {
            "method": method,
            "step_ms": statistics.median(statistics.fmean(r["steps"]) for r in runs) * 1e3,
            "slowdown": statistics.median(statistics.fmean(r["steps"]) / none for r, none in zip(runs, nones)),
            "blocking_s": None,
            "blocking_s_per_gb": None,
            "commit_s": None,
            "bit_exact": None,
        }
        if method != "none":
            blocking = statistics.median(r["blocking"] for r in runs)
            row.update(
                blocking_s=blocking,
                blocking_s_per_gb=blocking / gb,
                commit_s=statistics.median(r["commit"] for r in runs),
                bit_exact=not runs[-1]["problems"],
            )
        rows.append(row)
    return rows


def markdown(report: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    args, machine = report["args"], report["machine"]
    lines = [
        f"Async saves of {report['state_bytes'] / MiB:.0f} MiB of float32 {args['device']} tensors "
        f"({counted(report['tensors'], 'tensor')}, {args['width']}x{args['width']}) while a tanh MLP trains "
        f"(batch {args['batch']}); {machine['device']}, torch {machine['torch']}; "
        f"{counted(args['reps'], 'repetition')}, methods interleaved, at least {args['steps']} steps a window.",
        "",
        "| method | blocking (s) | blocking (s/GB) | mean step during the save (ms) | x no save "
        "| save to commit (s) | bit-exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            "" if row["blocking_s"] is None else f"{row['blocking_s']:.4f}",
            "" if row["blocking_s_per_gb"] is None else f"{row['blocking_s_per_gb']:.4f}",
            f"{row['step_ms']:.2f}",
            f"{row['slowdown']:.2f}x",
            "" if row["commit_s"] is None else f"{row['commit_s']:.2f}",
            "" if row["bit_exact"] is None else ("yes" if row["bit_exact"] else "NO"),
        ]
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"ckptlib's process-mode staging segments pinned: {'yes' if report.get('ckptlib_staging_pinned') else 'no'}."
    )
    if report["dcp_unavailable"]:
        lines.append(f"dcp_process_pinned left out: {report['dcp_unavailable']}.")
    else:
        options = ", ".join(f"{k}={v}" for k, v in report["dcp_staging_options"].items())
        lines.append(f"DCP's DefaultStager: StagingOptions({options}).")
    if args["device"] == "cpu":
        lines.append("Dry run on the CPU: the code path of the GPU run, not GPU numbers.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m ckptlib.bench.gpu_async",
        description=help_description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu (a dry run)")
    parser.add_argument("--mib", type=int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every method (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="fewest steps a window (default 20)")
    parser.add_argument("--width", type=int, help="the MLP's width (default 1024 on cuda, 256 on cpu)")
    parser.add_argument("--batch", type=int, help="rows of the activation (default 1024 on cuda, 64 on cpu)")
    parser.add_argument("--json", metavar="OUT", help="write the raw times and the summary as JSON to OUT")
    parser.add_argument("--dir", help="where the checkpoints go (default: the system temp dir)")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.mib < 1 or args.reps < 1 or args.steps < 1:
        parser.error("--mib, --reps and --steps must be positive")
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cuda":
        reason = no_cuda_reason()
        if reason is not None:
            print(
                f"gpu_async: {reason}: this benchmark needs a CUDA GPU and measured nothing; "
                "`--device cpu` runs the same code path on the CPU as a dry run",
                file=sys.stderr,
            )
            return NO_CUDA_EXIT
    started = time.perf_counter()
    report = run(args)
    report["seconds"] = time.perf_counter() - started
    rows = summarize(report)
    print(markdown(report, rows) + f"\n\nWall time of the benchmark: {report['seconds']:.0f} s.")
    problems = [(m, p) for rep in report["reps"] for m, r in rep["runs"].items() for p in r.get("problems", [])]
    for method, problem in problems:
        print(f"gpu_async: {method}: checkpoint not bit-exact: {problem}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": report, "summary": rows}, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
