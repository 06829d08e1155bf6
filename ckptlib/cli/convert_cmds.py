"""`ckpt convert` and `ckpt export`: a checkpoint in another format, written one tensor at a
time (`ckptlib.convert` and `ckptlib.export` do the work)."""

from __future__ import annotations

import argparse

from .usage import EXIT_OK, TRUSTED_HELP, UsageError, add_command, add_no_progress, show_progress

CONVERT_DESCRIPTION = """
Convert SRC (ckptlib, plain DCP from torch >= 2.0, a torch.save file, v0 per-rank files,
safetensors) to DST, streaming one tensor at a time. --to dcp writes a committed ckptlib
checkpoint loadable at any world size; --to torch one torch.save file of full tensors with the
saved nesting; --to safetensors the model tensors. Refuses to overwrite DST without --force.

SRC and a --to dcp DST may be a path or an s3://, gs:// or az:// URI; --to torch and --to
safetensors write local files. --to safetensors writes the tensors under --prefix, the prefix
stripped, as DST/model.safetensors (or the file DST when it ends in .safetensors); the values
it cannot hold are listed as skipped. --force replaces only what ckptlib recognises as a
checkpoint (its files, a torch.save or safetensors file; in a safetensors directory, the
model*.safetensors files and index, not a config or tokenizer beside them) and refuses
anything else. A checkpoint is never converted onto itself.

Prints one line with the tensors, objects, bytes and seconds, then notes about the source and
what was skipped.

Exit status: 0 converted; 1 DST already holds a checkpoint (without --force), the source is
damaged or holds nothing to convert, a storage error; 2 no checkpoint at SRC, or DST holds
files ckptlib may not replace.
"""

EXPORT_DESCRIPTION = """
Write SRC (any checkpoint ckptlib reads, at any saved world size, or a CheckpointManager root:
its latest step, or --step) as one consolidated model in DST, streaming one tensor at a time.

- --format safetensors: model.safetensors, or model-0000k-of-0000n.safetensors plus
  model.safetensors.index.json when the tensors exceed --max-shard-size.
- --format torch: pytorch_model.bin (torch.save of a flat name->tensor dict), or
  pytorch_model-0000k-of-0000n.bin plus pytorch_model.bin.index.json.
- A DST ending in .safetensors (.bin/.pt/.pth for torch) is one file, never sharded.

--model-only writes the 'model' entry's tensors without the 'model.' prefix (the names
transformers' loaders expect); otherwise every tensor under its full key. Non-tensor values are
never exported. Refuses to write into an existing DST unless --force, and even then only when
DST is an export ckptlib wrote (ckptlib_export.json lists its files, and --force removes exactly
those). SRC may be a path or an s3://, gs:// or az:// URI; DST is local. Peak memory is about
the largest tensor plus a few tens of MiB.

Prints one line with the step, tensors, bytes, files, seconds and MiB/s, then the tensors and
values not exported.

Exit status: 0 exported; 1 DST exists (without --force) or is not an export ckptlib wrote, the
source is damaged, a storage error; 2 no checkpoint at SRC (or no such --step), a bad --dtype
or --max-shard-size.
"""


def add_parsers(commands) -> None:
    p = add_command(
        commands,
        "convert",
        help="convert any readable checkpoint to ckptlib/DCP, one torch.save file, or safetensors",
        description=CONVERT_DESCRIPTION,
    )
    p.add_argument("src", help="the checkpoint to convert: a path, file://, s3://, gs:// or az:// URI")
    p.add_argument(
        "dst",
        help="where to write it: a directory or URI (--to dcp), a file (--to torch), a directory or a "
        ".safetensors file (--to safetensors)",
    )
    p.add_argument("--to", choices=["dcp", "torch", "safetensors"], default="dcp", help="target format (default dcp)")
    p.add_argument("--force", action="store_true", help="overwrite DST if it exists (only a checkpoint ckptlib knows)")
    p.add_argument(
        "--prefix",
        default="model",
        help="the state key a flat model file (a torch.save state_dict, safetensors) is read under, and whose "
        "tensors --to safetensors writes (default model)",
    )
    p.add_argument("--trusted", action="store_true", help=TRUSTED_HELP)
    add_no_progress(p)
    p.set_defaults(func=run_convert)

    p = add_command(
        commands,
        "export",
        help="export a checkpoint as one consolidated model in Hugging Face's layout",
        description=EXPORT_DESCRIPTION,
    )
    p.add_argument("src", help="a checkpoint (path, file://, s3://, gs:// or az:// URI) or a CheckpointManager root")
    p.add_argument("dst", help="a local directory (or one .safetensors/.bin file)")
    p.add_argument("--format", choices=["safetensors", "torch"], default="safetensors", help="default safetensors")
    p.add_argument(
        "--dtype", default=None, help="cast floating-point tensors, e.g. bfloat16 (integer tensors keep theirs)"
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest shard: bytes or 5GB / 500MB / 2GiB as Hugging Face spells it (default 5GB; GB = 10^9 bytes, "
        "GiB = 2^30); a larger tensor gets a shard of its own",
    )
    p.add_argument("--model-only", action="store_true", help="only the model's tensors, without the 'model.' prefix")
    p.add_argument("--step", type=int, default=None, help="with a CheckpointManager root: this step instead of latest")
    p.add_argument("--force", action="store_true", help="replace an export ckptlib wrote earlier at DST")
    p.add_argument("--trusted", action="store_true", help=TRUSTED_HELP)
    add_no_progress(p)
    p.set_defaults(func=run_export)


def run_convert(args: argparse.Namespace) -> int:
    from ..convert import convert
    from ..format.source import detect_format

    detect_format(args.src)  # not-a-checkpoint / missing: exit 2 with the reason
    result = convert(
        args.src,
        args.dst,
        to=args.to,
        force=args.force,
        progress=show_progress(args),
        prefix=args.prefix,
        trusted=args.trusted,
    )
    print(
        f"converted {result.src} ({result.src_format}) -> {result.dst} ({result.to}): "
        f"{result.tensors} tensors, {result.objects} objects, {result.tensor_bytes} bytes in {result.seconds:.2f}s"
    )
    for note in result.notes:
        print(f"note: {note}")
    if result.skipped:
        print(f"skipped (not representable in {result.to}): {', '.join(result.skipped[:20])}")
    return EXIT_OK


def run_export(args: argparse.Namespace) -> int:
    from ..export import export, parse_dtype, parse_size

    try:
        dtype = parse_dtype(args.dtype)
        shard = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    result = export(
        args.src,
        args.dst,
        format=args.format,
        dtype=dtype,
        max_shard_size=shard,
        model_only=args.model_only,
        step=args.step,
        force=args.force,
        progress=show_progress(args),
        trusted=args.trusted,
    )
    rate = result.mib_per_s
    print(
        f"exported {result.src} ({result.src_format}, step {'-' if result.step is None else result.step}) -> "
        f"{result.dst} ({result.format}{', ' + result.dtype if result.dtype else ''}): {result.tensors} tensors, "
        f"{result.bytes} bytes in {len(result.files)} file{'s' if len(result.files) != 1 else ''}, "
        f"{result.seconds:.2f}s" + (f" ({rate:.1f} MiB/s)" if rate else "")
    )
    if result.skipped:
        shown = ", ".join(result.skipped[:10]) + (
            f" ... ({len(result.skipped)} in all)" if len(result.skipped) > 10 else ""
        )
        print(f"not exported: {shown}")
    return EXIT_OK
