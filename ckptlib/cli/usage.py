"""What every `ckpt` command shares: the exit codes, the one-line usage error, the help layout
and the arguments several commands take (a storage URI, the progress bar)."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (`| head`), as a shell reports SIGPIPE

CHECKPOINT_URI_HELP = (
    "a checkpoint directory, or a checkpoint root (its latest step, or --step): path, file://, s3://, gs:// or "
    "az:// URI"
)
ROOT_URI_HELP = "a checkpoint root: path, file://, s3://, gs:// or az:// URI"
NO_PROGRESS_HELP = "no progress bar (there is none when stderr is not a terminal either)"
TRUSTED_HELP = (
    "allow arbitrary unpickling of objects in torch.save sources (only for files you trust: unpickling can run code)"
)


PRESET_HELP = (
    "read another tool's layout: composer, torchtitan or lightning (its save folder's newest checkpoint, its keys, "
    "the plain-data objects it saves without --trusted)"
)


class UsageError(Exception):
    """A bad argument: reported as one line with exit code 2."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, except that a description or epilog keeps its paragraphs (blank
    lines) and its "- " list items, and no line is broken inside a hyphenated word such as
    --keep-last."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = []
        for paragraph in re.split(r"\n\s*\n", text.strip()):
            lines = []
            for item in re.split(r"\n\s*(?=- )", paragraph.strip()):
                hang = "  " if item.startswith("- ") else ""
                lines.append(
                    textwrap.fill(
                        " ".join(item.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent + hang,
                        break_on_hyphens=False,
                    )
                )
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def int_at_least(minimum: int, expected: str):
    """An argparse `type` for an integer >= `minimum`; `expected` says what in the error
    ("expected {expected}, got '...'")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


def add_command(commands, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """A `ckpt NAME` subcommand with the shared help layout."""
    return commands.add_parser(name, help=help, description=description, formatter_class=HelpFormatter)


def add_json(parser: argparse.ArgumentParser, keys: str) -> None:
    """`--json`: the command's report as one JSON object with `keys` on stdout, nothing else."""
    parser.add_argument("--json", action="store_true", help=f"print the report as JSON with the keys {keys}")


def add_no_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)


def show_progress(args: argparse.Namespace) -> bool:
    """A progress bar only on a terminal: never when stderr is piped or with --no-progress."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def progress_bar(args: argparse.Namespace, desc: str, total: int | None = None, unit: str = "B"):
    """A tqdm bar on stderr, disabled unless `show_progress(args)`."""
    from tqdm.auto import tqdm

    scale = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        disable=not show_progress(args),
        leave=False,
        file=sys.stderr,
    )


def open_uri(uri: str):
    """The storage for a URI the user typed; a bad URI is a usage error."""
    from ckptlib.errors import StorageError
    from ckptlib.storage import open_storage

    try:
        return open_storage(uri)
    except StorageError as exc:
        raise UsageError(str(exc)) from None


def add_preset(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["composer", "torchtitan", "lightning"], default=None, help=PRESET_HELP)


def preset_of(args: argparse.Namespace):
    """The `ckptlib.presets` preset `--preset` names, or None."""
    name = getattr(args, "preset", None)
    if name is None:
        return None
    from ckptlib import presets  # imports torch: only when a preset is named

    return presets.get(name)
