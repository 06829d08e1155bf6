"""`ckpt verify`, `ckpt inspect`, `ckpt ls`: the commands that read checkpoints and roots and
change nothing."""

from __future__ import annotations

import argparse
import json
import os

from ckptlib.cli.listing import age_seconds, human_age, human_bytes, metric_text
from ckptlib.cli.roots import Resolved, add_step, resolve_arg
from ckptlib.cli.usage import (
    CHECKPOINT_URI_HELP,
    EXIT_FAIL,
    EXIT_OK,
    ROOT_URI_HELP,
    UsageError,
    add_command,
    add_no_progress,
    add_preset,
    open_uri,
    preset_of,
    progress_bar,
)

VERIFY_DESCRIPTION = """
Read every file of one checkpoint and check it: the manifest, each file's size and CRC-32
(whole file and every item), that every tensor's saved chunks cover it exactly, that every
storage record lies inside the directory and its file, and that each tensor item holds the
shape and dtype .metadata declares for it. .metadata is unpickled with an allowlist only. A
plain DCP checkpoint has no checksums: its structure is checked. Safetensors (one file, a
directory with model.safetensors, or shards and their index, e.g. an export): every header as
a load checks it, every file the index names, every byte read. URI may be a checkpoint root
(a CheckpointManager's directory): its latest step is verified, or --step N, and the first
line says which. With --preset, URI may be that tool's save folder (its newest checkpoint is
verified). Reads only; changes nothing.

Prints one line per problem, naming the file (notes, such as a file the manifest does not
list, are printed too but are not damage), then "URI: OK" or "URI: DAMAGED, N problems".

Exit status: 0 intact, 1 damaged, 2 no checkpoint at URI (a root without committed steps, or
without --step N).
"""

INSPECT_DESCRIPTION = """
Show a checkpoint's format (ckptlib, dcp or safetensors), step, saved world size, torch
version, total bytes and every tensor's key, shape, dtype and number of saved chunks, and the
keys of its non-tensor objects, from its manifest and .metadata (no shard is read; a
safetensors file or directory: its headers and index; use `ckpt verify` to check the data),
one per line. URI may be a checkpoint root (a CheckpointManager's directory): its latest step
is described, or --step N, and the first line says which. With --preset, URI may be that
tool's save folder (its newest checkpoint). Other formats (torch.save, v0 files) are read by
`ckpt convert` and `ckpt export`.

Exit status: 0 described; 1 the manifest or .metadata is damaged or unsafe; 2 no checkpoint
at URI (a root without committed steps, or without --step N).
"""

LS_DESCRIPTION = """
List the steps under a checkpoint root (a CheckpointManager's directory): committed, incomplete
or corrupt (incomplete: a save that has not committed, in progress or crashed; corrupt: an
unreadable manifest), or foreign (only files ckptlib did not write, e.g. a plain DCP checkpoint
put there; gc never touches these); size, age (since the manifest was written), saved world
size, which is latest (*), the metrics given to the save, and who holds the root's lock. Reads
only; changes nothing.

A save folder of another tool (Composer's ep*-ba* folders and latest-rank0.pt, torchtitan's
step-N, Lightning's *step=N.ckpt) is listed as that tool lays it out: found by itself when the
root holds no ckptlib steps, or named with --preset; state "dcp" is a complete plain DCP save.
A single checkpoint (not a root) is listed as one row, its state its format (committed for
ckptlib's, dcp, safetensors, torch_save, v0), after a line that says so.

--json: root, checkpoint (the format of the single checkpoint ROOT is, else null), latest, lock
and steps (each with step, name, state, bytes (= size), world_size, latest, created,
age_seconds, metrics); with a preset also "preset".

Exit status: 0 listed; 1 a storage error; 2 no such checkpoint root.
"""


def add_parsers(commands) -> None:
    p = add_command(
        commands,
        "verify",
        help="check a checkpoint's files against its manifest and its metadata",
        description=VERIFY_DESCRIPTION,
    )
    p.add_argument("uri", help=CHECKPOINT_URI_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON with the keys checkpoint, format, intact (true/false), problems (a list of {file, kind, "
        "message, line}; kind is corrupt, missing, unsafe, incomplete or note) and root (as inspect --json); the "
        "exit status is the same",
    )
    add_step(p)
    add_preset(p)
    add_no_progress(p)
    p.set_defaults(func=run_verify)

    p = add_command(
        commands,
        "inspect",
        help="describe a checkpoint: format, step, world size, tensors",
        description=INSPECT_DESCRIPTION,
    )
    p.add_argument("uri", help=CHECKPOINT_URI_HELP)
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON with the keys format, step, world_size, torch_version, total_bytes, tensors "
        "(a list of {key, shape, dtype, chunks}), objects (their keys) and root (the checkpoint root it read a step "
        "of: {uri, step, chosen, warning}, or null)",
    )
    add_step(p)
    add_preset(p)
    p.set_defaults(func=run_inspect)

    p = add_command(commands, "ls", help="list the steps under a checkpoint root", description=LS_DESCRIPTION)
    p.add_argument("root", help=ROOT_URI_HELP)
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    add_preset(p)
    p.set_defaults(func=run_ls)


def _checkpoint(args: argparse.Namespace):
    """The checkpoint a command reads (a root's latest step or --step: its note printed first)
    and its format (None: not one ckptlib reads; the command's own check then says what is
    there)."""
    from ckptlib.errors import CheckpointError
    from ckptlib.format.source import detect_format

    preset = preset_of(args)
    if preset is None:
        resolved = resolve_arg(args, args.uri)
    elif args.step is not None:
        raise UsageError(
            f"--step {args.step}: with --preset, URI is that tool's save folder and its newest checkpoint is read"
        )
    else:
        resolved = Resolved(preset.resolve(open_uri(args.uri)))
    try:
        return resolved, detect_format(resolved.storage)
    except CheckpointError:
        return resolved, None


def run_verify(args: argparse.Namespace) -> int:
    from ckptlib.format.safetensors_check import verify_safetensors
    from ckptlib.format.verify import verify

    resolved, fmt = _checkpoint(args)
    storage = resolved.storage
    bar = progress_bar(args, "ckpt verify")
    check = verify_safetensors if fmt == "safetensors" else verify

    def start(total: int) -> None:
        bar.reset(total=total)

    try:
        problems = check(storage, on_start=start, on_bytes=bar.update)
    finally:
        bar.close()
    errors = [p for p in problems if p.is_error]
    if args.json:
        doc = {
            "checkpoint": storage.uri,
            "format": fmt,
            "intact": not errors,
            "problems": [
                {"file": p.file, "kind": p.kind, "message": p.message, "line": p.line(storage.uri)} for p in problems
            ],
            "root": resolved.to_json(),
        }
        print(json.dumps(doc, indent=1))
        return EXIT_FAIL if errors else EXIT_OK
    for p in problems:
        print(p.line(storage.uri))
    if errors:
        print(f"{storage.uri}: DAMAGED, {len(errors)} problem{'s' if len(errors) != 1 else ''}")
        return EXIT_FAIL
    print(f"{storage.uri}: OK")
    return EXIT_OK


def run_inspect(args: argparse.Namespace) -> int:
    from ckptlib.format.safetensors_check import summarize_safetensors
    from ckptlib.format.verify import summarize

    resolved, fmt = _checkpoint(args)
    storage = resolved.storage
    summary = summarize_safetensors(storage) if fmt == "safetensors" else summarize(storage)
    if args.json:
        doc = {**summary.to_json(), "objects": summary.objects, "root": resolved.to_json()}
        print(json.dumps(doc, indent=1))
        return EXIT_OK

    def show(value):
        return "-" if value is None else value

    print(f"checkpoint:    {summary.uri}")
    print(f"format:        {summary.format}")
    print(f"step:          {show(summary.step)}")
    print(f"world size:    {show(summary.world_size)}")
    print(f"torch version: {show(summary.torch_version)}")
    print(f"total bytes:   {summary.total_bytes}")
    print(f"tensors:       {len(summary.tensors)}")
    if summary.tensors:
        width = max(len(t["key"]) for t in summary.tensors)
        for t in summary.tensors:
            shape = "(" + ", ".join(map(str, t["shape"])) + ("," if len(t["shape"]) == 1 else "") + ")"
            print(
                f"  {t['key']:<{width}}  {shape:<16} {t['dtype']:<10} "
                f"{t['chunks']} chunk{'s' if t['chunks'] != 1 else ''}"
            )
    print(f"objects:       {len(summary.objects)}")
    for key in summary.objects:
        print(f"  {key}")
    return EXIT_OK


def _row(storage, name: str, step: int | None, state: str, files: dict[str, int], latest: bool) -> dict:
    """One `ckpt ls` row: a step directory (or a single checkpoint) and what its manifest says."""
    from ckptlib.errors import CheckpointError
    from ckptlib.format.native.manifest import MANIFEST_NAME, Manifest

    row = {
        "step": step,
        "name": name,
        "state": state,
        "bytes": sum(files.values()),
        "size": sum(files.values()),
        "world_size": None,
        "latest": latest,
        "created": None,
        "age_seconds": None,
        "metrics": {},
    }
    if state == "committed":
        try:
            manifest = Manifest.from_bytes(storage.read(MANIFEST_NAME), f"{storage.uri}/{MANIFEST_NAME}")
        except CheckpointError:
            row["state"] = "corrupt"
        else:
            row["world_size"] = manifest.world_size
            row["created"] = manifest.created or None
            age = age_seconds(manifest.created)
            row["age_seconds"] = None if age is None else round(age, 3)
            row["metrics"] = dict(getattr(manifest, "metrics", None) or {})
    return row


def _single_checkpoint_row(storage) -> tuple[str, dict] | None:
    """(its format, its row) when the root given to `ckpt ls` is itself one checkpoint, else None."""
    from ckptlib.errors import CheckpointError
    from ckptlib.format.safetensors_check import summarize_safetensors
    from ckptlib.format.source import detect_format
    from ckptlib.format.verify import summarize
    from ckptlib.storage.base import root_is_file

    try:
        fmt = detect_format(storage)
    except CheckpointError:
        return None
    state = "committed" if fmt == "ckptlib" else fmt
    if fmt == "safetensors":
        summary = summarize_safetensors(storage)
    elif fmt in ("ckptlib", "dcp"):
        summary = summarize(storage)
    else:
        summary = None
    local = storage.local_path() if root_is_file(storage) else None
    files = {".": os.path.getsize(local)} if local is not None else storage.list()
    row = _row(storage, ".", None if summary is None else summary.step, state, files, False)
    if summary is not None and row["world_size"] is None:
        row["world_size"] = summary.world_size
    return fmt, row


def run_ls(args: argparse.Namespace) -> int:
    """A root of ckptlib steps is listed from its manifests alone, without importing torch (a
    fraction of a second); another tool's folder or a single checkpoint file needs the presets
    and readers, which do."""
    from ckptlib.format.native.root import LATEST, scan, step_dir
    from ckptlib.manager.lock import RootLock
    from ckptlib.storage.base import root_is_file

    storage = open_uri(args.root)
    a_file = root_is_file(storage)  # a torch.save or safetensors file: one checkpoint, at most
    if not a_file and not storage.exists():
        raise UsageError(f"{args.root}: no such checkpoint root")
    preset = preset_of(args)
    infos = scan(storage) if preset is None and not a_file else []
    if preset is None and not infos and not a_file:
        from ckptlib import presets

        preset = presets.detect_root(storage)
    single = _single_checkpoint_row(storage) if preset is None and not infos else None
    if preset is not None:
        infos = preset.scan(storage)
        pointer = preset.latest(storage)
    else:
        pointer = None if single is not None else storage.read_pointer(LATEST)
    holder = None if a_file else RootLock(storage).holder()
    rows = [
        _row(
            storage.child(info.name),
            info.name,
            info.step,
            info.state,
            info.files,
            pointer == (info.name if preset is not None else step_dir(info.step)),
        )
        for info in infos
    ] + ([single[1]] if single is not None else [])
    if args.json:
        lock = holder.to_json() if holder is not None else None
        listing = {
            "root": args.root,
            "checkpoint": None if single is None else single[0],
            "latest": pointer,
            "lock": lock,
            "steps": rows,
        }
        if preset is not None:
            listing["preset"] = preset.name
        print(json.dumps(listing, indent=1))
        return EXIT_OK
    if preset is not None:
        print(f"{preset.client} save folder: {', '.join(r['name'] for r in rows) or 'no checkpoints'}")
    if single is not None:
        print(f"{args.root}: a single checkpoint ({single[0]}), not a checkpoint root")
    print(f"{'step':>10}  {'state':<10} {'world':>5} {'size':>10} {'age':>6}  latest  metrics")
    for r in rows:
        ws = "-" if r["world_size"] is None else str(r["world_size"])
        step = "-" if r["step"] is None else str(r["step"])
        metrics = " ".join(f"{k}={metric_text(v)}" for k, v in sorted(r["metrics"].items()))
        line = (
            f"{step:>10}  {r['state']:<10} {ws:>5} {human_bytes(r['bytes']):>10} {human_age(r['age_seconds']):>6}"
            f"  {'*' if r['latest'] else '':<6}  {metrics}"
        )
        print(line.rstrip())
    if holder is not None:
        print(f"locked by {holder.describe()}")
    return EXIT_OK
