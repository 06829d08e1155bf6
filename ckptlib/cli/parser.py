"""`ckpt`'s argument parser: the top level, and each command family's subcommands."""

from __future__ import annotations

import argparse

from ckptlib._version import __version__
from ckptlib.cli import bench_cmd, convert_cmds, diff_cmd, gc_cmds, inspect_cmds, plan_cmd, validate_cmd
from ckptlib.cli.usage import HelpFormatter

DESCRIPTION = (
    "Elastic sharded checkpoints for PyTorch: validate a setup or your own training job; verify, inspect, plan a "
    "resharded load of, compare and manage checkpoints."
)

EPILOG = """
A URI is a local path, file:///path, s3://bucket/prefix, gs://bucket/prefix or
az://container/prefix (the clouds need ckptlib[s3], ckptlib[gcs] or ckptlib[azure]). A
checkpoint is one saved directory; a checkpoint root is a CheckpointManager's directory of
step directories. Every command that takes a checkpoint also takes a root: it reads the step
the root's latest pointer names, or --step N, and its first line says which.

Exit status: 0 success; 1 a check failed (a failing validate pair, a damaged checkpoint, a root
locked by another writer, a storage or I/O error, two checkpoints that differ, a load plan that
does not fit); 2 a usage error or a path that is not what the command needs (no checkpoint
there), and every error of `plan` and `diff`; 130 interrupted; 141 stdout closed before the
output ended (a pipe into head: the output stops there, without a message). Errors are one
line on stderr ("ckpt COMMAND: error: ..."), never a traceback (a --spec whose own code failed
adds its traceback). `ckpt COMMAND --help` describes each command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt", description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckpt (ckptlib) {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    validate_cmd.add_parser(commands)
    inspect_cmds.add_parsers(commands)
    plan_cmd.add_parser(commands)
    diff_cmd.add_parser(commands)
    gc_cmds.add_gc_parser(commands)
    convert_cmds.add_parsers(commands)
    gc_cmds.add_unlock_parser(commands)
    bench_cmd.add_parser(commands)
    return parser
