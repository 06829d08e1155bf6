"""The `ckpt` command: validate a cluster/storage pair, check and describe checkpoints, and
operate on checkpoint roots.

Exit codes: 0 success, 1 a check failed (validation failure, damaged checkpoint, a locked
root, a storage error), 2 usage errors or a path that is not what the command needs (no
checkpoint there). User errors print one line, never a traceback.

One module per command family: `validate_cmd` (validate), `inspect_cmds` (verify, inspect,
ls), `plan_cmd` (plan: a resharded load's reads, from metadata), `diff_cmd` (diff), `gc_cmds`
(gc, unlock), `convert_cmds` (convert, export), `bench_cmd` (bench, which runs
`ckptlib.bench`); `parser` assembles them, `usage` holds what they share and `listing` how
`ckpt ls` shows a root. `plan` and
`diff` exit 2 on every error (a CheckpointError), since their 1 means "does not fit" and
"differs".
"""

from __future__ import annotations

import sys
from typing import Sequence

from ckptlib.cli.bench_cmd import report_stdout, run_bench
from ckptlib.cli.parser import build_parser
from ckptlib.cli.usage import EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ckpt ARGV...` and return its exit code (`ckpt = "ckptlib.cli:main"`)."""
    from ckptlib.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from ckptlib._scrub import scrub_message

    def report(exc: BaseException) -> None:  # never a credential on the terminal, whatever raised it
        print(scrub_message(f"ckpt {args.command}: error: {exc}"), file=sys.stderr)

    try:
        return args.func(args)
    except (UsageError, CheckpointNotFoundError, NotACheckpointError) as exc:
        report(exc)
        return EXIT_USAGE
    except CheckpointError as exc:
        report(exc)
        return getattr(args, "error_exit", EXIT_FAIL)  # plan and diff: 2 (their 1 means "differs")
    except OSError as exc:  # e.g. permission denied reading a file
        report(exc)
        return getattr(args, "error_exit", EXIT_FAIL)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


__all__ = ["main", "build_parser", "report_stdout", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE"]
