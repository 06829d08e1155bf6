"""The benchmarks behind `ckpt bench`, shipped with ckptlib so they run from any install.

- `ckpt bench` (`throughput`): save, load, resharded load, peak RSS, async save and the cloud
  backends against raw DCP, torch.save, the disk and each SDK, side by side in one run. Its
  rank bodies: `local_io`, `reshard_load`, `cloud_sdk` (on the helpers in `rank_ops`); its
  report: `throughput_summary`, `throughput_plot`. It measures the machine's ceilings first
  (`ceilings`, summarized by `ceiling_summary`), repeats with `paired`, and meters checksums
  with `crc_meter`.
- `ckpt bench read-once` (`read_once`): the bytes and time of a load with and without read-once.
- `ckpt bench tensors` (`tensor_counts`): save and load time per tensor count against raw DCP.
- `ckpt bench tier` (`tier`): the cluster tier's blocking save, upload and resume against a
  plain save, concurrent SDK uploads and the remote bytes read.
- `ckpt bench async` (`async_modes`, its rank body `async_ranks`): a training loop's step time
  while an async save runs, without a save and in async_mode "thread" and "process", the first
  save's latency and a save's host memory, with and without a staging cap.
- `ckpt bench recovery` (`recovery`, its ranks in `recovery_worker`, its report in
  `recovery_summary`): a lost host under torchrun's elastic agent timed phase by phase, peer
  against remote restores, and the step slowdown of every-step saves to an in-memory tier.
- `ckpt bench scale` (`scale`, with `s3_requests`): coordinator planning time and memory and
  record sizes at simulated world sizes (one cell each: `scale_cell`); S3 request counts of
  real saves and loads; with `--ranks`, real gloo ranks (`scale_ranks`): each operation's
  collectives, bytes, groups, store operations and sockets, counted by `dist_counters`.
- run as `python -m ckptlib.bench.NAME`: `launch_speed` (the distributed test harness against
  fresh spawns; needs a source checkout), `small_items` (per-item cost of small tensors),
  `s3_requests`, `storage_clients` (the cloud SDKs against obstore), `gpu_async` (on one GPU:
  the blocking time and step slowdown of async saves of CUDA state, thread, process and
  background staging against DCP's process checkpointer with pinned memory; `--device cpu` is a
  dry run; `ci/gpu.sh` runs it).

Nothing here is imported by the library itself. `counted` words a count for the benchmarks'
reports and for `ckpt`'s own lines; `emit` prints a benchmark's tables and writes its JSON report.
"""


def help_description(doc: str) -> str:
    """A benchmark module's docstring as its `--help` description: every paragraph except the
    one that starts with "Run:" (argparse prints the usage itself)."""
    return "\n\n".join(p for p in doc.strip().split("\n\n") if not p.startswith("Run:"))


def emit(text: str, report, json_to: str | None) -> None:
    """A benchmark's tables and its JSON report: the tables to stdout, or to stderr when the
    report goes to stdout (`--json` without a file, `json_to == "-"`); else the report to the
    file `json_to`, if any."""
    import json
    import sys

    to_stdout = json_to == "-"
    print(text, file=sys.stderr if to_stdout else sys.stdout)
    if not json_to:
        return
    if to_stdout:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        with open(json_to, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: "1 rank", "2 ranks", "1 process", "3 processes"."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
