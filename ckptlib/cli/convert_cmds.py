"""`ckpt convert` and `ckpt export`: a checkpoint in another format, written one tensor at a
time (`ckptlib.convert` and `ckptlib.export` do the work)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from ckptlib.bench import counted
from ckptlib.cli.roots import add_step, resolve_arg, step_number
from ckptlib.cli.usage import (
    EXIT_OK,
    TRUSTED_HELP,
    UsageError,
    add_command,
    add_json,
    add_no_progress,
    add_preset,
    open_uri,
    preset_of,
    show_progress,
)

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
what was skipped. SRC may be a checkpoint root (a CheckpointManager's directory): its latest
step is converted, or --step N, and the first line says which.

Exit status: 0 converted; 1 DST already holds a checkpoint (without --force), the source is
damaged or holds nothing to convert, a storage error; 2 no checkpoint at SRC (a root without
committed steps, or without --step N), or DST holds files ckptlib may not replace.
"""

EXPORT_DESCRIPTION = """
Write SRC (any checkpoint ckptlib reads, at any saved world size, or a CheckpointManager root:
its latest step, or --step) as one consolidated model in DST, streaming one tensor at a time.

- --format safetensors: model.safetensors, or model-0000k-of-0000n.safetensors plus
  model.safetensors.index.json when the tensors exceed --max-shard-size.
- --format torch: pytorch_model.bin (torch.save of a flat name->tensor dict), or
  pytorch_model-0000k-of-0000n.bin plus pytorch_model.bin.index.json.
- A DST ending in .safetensors (.bin/.pt/.pth for torch) is one file, never sharded.

By default the model alone: the 'model' entry's tensors without the 'model.' prefix (the names
transformers' from_pretrained expects; with --preset, that tool's model keys: Composer's
state.model.*, Lightning's state_dict.*, torchtitan's top-level keys); a checkpoint without a
'model' entry that holds a plain model state dict exports every tensor, one with other entries
(net + optim) is refused, naming them. --model-only insists on the 'model' entry; --prefix NAME
writes the tensors of the entry NAME instead; --all every tensor under its full key, optimizer
state included. --key-map renames them after that:
OLD=NEW replaces the prefix OLD by NEW (OLD= strips it), a JSON file {"OLD": "NEW"} does the
same (null leaves those tensors out), a text file holds one OLD=NEW a line; the longest prefix
wins. Non-tensor values are never exported.

Tied weights are written once, as transformers does (lm_head.weight is left out when it is
stored in the same bytes as the input embeddings, or when the config says
tie_word_embeddings: true and the two are equal). --hf-config copies a config.json (a file, or
a model directory's config.json and generation_config.json) into DST, naming --dtype in it;
--copy-from DIR copies every file of DIR other than weights (tokenizer, README, ...). Files
already in DST that are not weights (a config.json saved first, a tokenizer) are kept.

Refuses to write into a DST that holds weights ckptlib did not write, or an earlier export
unless --force, which removes exactly the files ckptlib_export.json lists (it names no
absolute path: the directory can be published as is). SRC may be a path or an s3://, gs://
or az:// URI; DST is local. Peak memory is about the largest tensor plus a few tens of MiB.

Prints one line with the step, tensors, bytes, files, seconds and MiB/s, then the tensors and
values not exported; from a root, first the line that says which step it read.

Exit status: 0 exported; 1 DST exists (without --force) or is not an export ckptlib wrote, the
source is damaged, a storage error; 2 no checkpoint at SRC (or no such --step), a bad --dtype
or --max-shard-size, --all with --model-only or --prefix.
"""


def add_parsers(commands) -> None:
    p = add_command(
        commands,
        "convert",
        help="convert any readable checkpoint to ckptlib/DCP, one torch.save file, or safetensors",
        description=CONVERT_DESCRIPTION,
    )
    p.add_argument(
        "src",
        help="the checkpoint to convert: a path, file://, s3://, gs:// or az:// URI, or a checkpoint root (its "
        "latest step, or --step)",
    )
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
    add_json(p, "src, dst, src_format, to, tensors, objects, tensor_bytes, files, skipped, notes, seconds")
    add_step(p)
    add_preset(p)
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
    p.add_argument(
        "--model-only",
        action="store_true",
        help="only the 'model' entry's tensors, without the 'model.' prefix (the default when there is one)",
    )
    p.add_argument("--prefix", default=None, help="only the tensors of this state entry, without its prefix")
    p.add_argument("--all", action="store_true", help="every tensor under its full key, optimizer state included")
    p.add_argument(
        "--key-map",
        action="append",
        default=[],
        metavar="OLD=NEW|FILE",
        help="rename tensors by prefix (repeatable): OLD=NEW, or a JSON / OLD=NEW-lines file",
    )
    p.add_argument("--hf-config", default=None, metavar="PATH|DIR", help="copy this config.json (or a model dir's) in")
    p.add_argument("--copy-from", default=None, metavar="DIR", help="copy DIR's side files (tokenizer, README...) in")
    p.add_argument(
        "--step",
        type=step_number,
        default=None,
        metavar="N",
        help="with a checkpoint root (a CheckpointManager's directory, or --preset's save folder): this step, not "
        "its latest",
    )
    p.add_argument("--force", action="store_true", help="replace an export ckptlib wrote earlier at DST")
    p.add_argument("--trusted", action="store_true", help=TRUSTED_HELP)
    add_json(p, "src, dst, src_format, format, step, world_size, dtype, tensors, bytes, files, skipped, seconds, tied")
    add_preset(p)
    add_no_progress(p)
    p.set_defaults(func=run_export)


def parse_key_map(values: list[str]) -> dict[str, str | None] | None:
    """--key-map values as one {old prefix: new prefix (None: leave out)} mapping."""
    out: dict[str, str | None] = {}

    def add(old: str, new: str | None, where: str) -> None:
        if old in out and out[old] != new:
            raise UsageError(f"--key-map: {where} maps {old!r} again (to {new!r}, before to {out[old]!r})")
        out[old] = new

    for value in values:
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                text = f.read()
            if text.lstrip().startswith("{"):
                try:
                    doc = json.loads(text)
                except ValueError as exc:
                    raise UsageError(f"--key-map {value}: not valid JSON ({exc})") from None
                if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in doc.items()):
                    raise UsageError(f"--key-map {value}: must map prefixes to prefixes (str) or null")
                for old, new in doc.items():
                    add(old, new, value)
                continue
            lines = [line.strip() for line in text.splitlines()]
            pairs = [(line, value) for line in lines if line and not line.startswith("#")]
        else:
            pairs = [(value, "--key-map")]
        for pair, where in pairs:
            if "=" not in pair:
                raise UsageError(f"{where}: {pair!r} is not OLD=NEW (nor a file)")
            old, new = pair.split("=", 1)
            add(old.strip(), new.strip(), where)
    return out or None


def run_convert(args: argparse.Namespace) -> int:
    from ckptlib.format.source import detect_format
    from ckptlib.offline.convert import convert

    preset = preset_of(args)
    if preset is None:
        src = resolve_arg(args, args.src).uri
    elif args.step is not None:
        raise UsageError(
            f"--step {args.step}: with --preset, SRC is that tool's save folder and its newest checkpoint is read"
        )
    else:
        src = args.src
    detect_format(src if preset is None else preset.resolve(open_uri(src)))  # missing: exit 2
    result = convert(
        src,
        args.dst,
        to=args.to,
        force=args.force,
        progress=show_progress(args),
        prefix=args.prefix,
        trusted=args.trusted,
        preset=preset,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=1))
        return EXIT_OK
    print(
        f"converted {result.src} ({result.src_format}) -> {result.dst} ({result.to}): "
        f"{counted(result.tensors, 'tensor')}, {counted(result.objects, 'object')}, "
        f"{counted(result.tensor_bytes, 'byte')} in {result.seconds:.2f}s"
    )
    for note in result.notes:
        print(f"note: {note}")
    if result.skipped:
        print(f"skipped (not representable in {result.to}): {', '.join(result.skipped[:20])}")
    return EXIT_OK


def run_export(args: argparse.Namespace) -> int:
    from ckptlib.format.output import parse_size
    from ckptlib.offline.export import export, parse_dtype

    try:
        dtype = parse_dtype(args.dtype)
        shard = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.all and (args.model_only or args.prefix is not None):
        raise UsageError("--all writes every tensor; it cannot be combined with --model-only or --prefix")
    preset = preset_of(args)
    src, step = (resolve_arg(args, args.src).uri, None) if preset is None else (args.src, args.step)
    result = export(
        src,
        args.dst,
        format=args.format,
        dtype=dtype,
        max_shard_size=shard,
        model_only=False if args.all else (True if args.model_only else None),
        prefix=args.prefix,
        key_map=parse_key_map(args.key_map),
        step=step,
        force=args.force,
        progress=show_progress(args),
        trusted=args.trusted,
        hf_config=args.hf_config,
        copy_from=args.copy_from,
        preset=preset,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=1))
        return EXIT_OK
    rate = result.mib_per_s
    print(
        f"exported {result.src} ({result.src_format}, step {'-' if result.step is None else result.step}) -> "
        f"{result.dst} ({result.format}{', ' + result.dtype if result.dtype else ''}): "
        f"{result.tensors} tensors, {counted(result.bytes, 'byte')} in {counted(len(result.files), 'file')}, "
        f"{result.seconds:.2f}s" + (f" ({rate:.1f} MiB/s)" if rate else "")
    )
    for name, kept in sorted(result.tied.items()):
        print(f"tied: {name} is {kept} (written once, as transformers does)")
    if result.skipped:
        shown = ", ".join(result.skipped[:10]) + (
            f" ... ({len(result.skipped)} in all)" if len(result.skipped) > 10 else ""
        )
        print(f"not exported: {shown}")
    return EXIT_OK
