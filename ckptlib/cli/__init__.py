"""The `ckpt` command: validate a cluster/storage pair, check and describe checkpoints, and
operate on checkpoint roots.

Exit codes: 0 success, 1 a check failed (validation failure, damaged checkpoint, a locked
root, a storage error), 2 usage errors or a path that is not what the command needs (no
checkpoint there), 141 stdout closed early (a pipe into `head`: quietly, as SIGPIPE would).
User errors print one line, never a traceback; so does each warning ("ckpt COMMAND: warning:
..."). A command that takes a checkpoint also takes a CheckpointManager root (its latest
step, or `--step`): `roots` resolves it.

One module per command family: `validate_cmd` (validate), `inspect_cmds` (verify, inspect,
ls), `plan_cmd` (plan: a resharded load's reads, from metadata), `diff_cmd` (diff), `gc_cmds`
(gc, unlock), `convert_cmds` (convert, export), `bench_cmd` (bench, which runs
`ckptlib.bench`); `parser` assembles them, `usage` holds what they share and `listing` how
`ckpt ls` shows a root, `roots` which checkpoint an argument names. `plan` and
`diff` exit 2 on every error (a CheckpointError), since their 1 means "does not fit" and
"differs".
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Sequence

from ckptlib.cli.bench_cmd import report_stdout, run_bench
from ckptlib.cli.parser import build_parser
from ckptlib.cli.usage import EXIT_BROKEN_PIPE, EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ckpt ARGV...` and return its exit code (`ckpt = "ckptlib.cli:main"`)."""
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        return _stdout_closed()


def _run(argv: list[str]) -> int:
    from ckptlib.errors import CheckpointError, CheckpointNotFoundError, NotACheckpointError

    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    parser = build_parser()
    if not argv:  # a bare `ckpt`: the help, as `ckpt --help` prints it
        parser.print_help()
        return EXIT_OK
    args = parser.parse_args(argv)
    from ckptlib._scrub import scrub_message

    def report(exc: BaseException) -> None:  # never a credential on the terminal, whatever raised it
        print(scrub_message(f"ckpt {args.command}: error: {exc}"), file=sys.stderr)

    def warn(message, category, filename, lineno, file=None, line=None) -> None:
        # one line per warning, as errors are: never Python's "file:line: Category:" header and
        # the source line of the entry point (`sys.exit(main())`)
        print(scrub_message(f"ckpt {args.command}: warning: {message}"), file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = warn
            code = args.func(args)
        sys.stdout.flush()  # a reader that went away is noticed here, not at interpreter exit
        return code
    except BrokenPipeError:
        raise
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


def _stdout_closed() -> int:
    """The reader of stdout went away (`ckpt ls ROOT | head -1`): stop without a message, as a
    process killed by SIGPIPE does, with its status 141; the rest of stdout goes to /dev/null so
    the interpreter's last flush does not complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # stdout is not a file (captured, replaced)
        pass
    return EXIT_BROKEN_PIPE


__all__ = ["main", "build_parser", "report_stdout", "EXIT_OK", "EXIT_FAIL", "EXIT_USAGE"]
