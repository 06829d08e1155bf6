"""`ckpt diff A B`: which tensors differ between two checkpoints (`ckptlib.offline.diff`)."""

from __future__ import annotations

import argparse
import json

from ckptlib.cli.roots import resolve_arg
from ckptlib.cli.usage import EXIT_FAIL, EXIT_OK, EXIT_USAGE, TRUSTED_HELP, add_command, add_no_progress, progress_bar

DESCRIPTION = """
Compare two checkpoints tensor by tensor: after a resume, a conversion or an export, which
tensors differ, where and by how much. A and B may be any formats ckptlib reads (ckptlib,
plain DCP, torch.save, v0, safetensors) saved at any world sizes: keys are the flat DCP keys
of this torch's rules (model.layers.0.weight, optim.state.layers.0.weight.exp_avg,
optim.param_groups.0.lr; a torch.save or safetensors model file's tensors under model.), also
for checkpoints of torch 1.13-2.3, whose nested values were stored whole (re-keyed as
ckpt convert re-keys them, so a conversion compares EQUAL with its source). Each tensor is
read in blocks of rows (16 MiB) from both sides at once, so memory stays a few blocks
whatever the checkpoint's size; nothing is written.

Reports: keys only in A or only in B; tensors whose shape or dtype differ; for every common
tensor whether it is bit-identical, how many elements differ by more than the tolerance
(|a - b| > atol + rtol * max(|a|, |b|): the same verdict with A and B swapped), the largest
absolute and relative difference and the index and both values of the largest; non-tensor
entries equal when of the same type and value. Integers are compared as integers (exact past
2^53); a finite value against inf, -inf or NaN always differs; the same infinity is equal;
NaN equals NaN unless --no-equal-nan; -0.0 equals 0.0 unless --bitwise (elements equal only
when their stored bits are; no tolerance). The text
output lists what differs and a summary line, then EQUAL or DIFFERENT; --json prints the
whole report (equal, a, b, atol, rtol, equal_nan, bitwise, summary, only_in_a, only_in_b, mismatched, tensors,
objects). A differing dtype makes a tensor differ even when its values are within tolerance.

Exit status: 0 equal (within --atol/--rtol; the default 0/0 means equal values); 1 they
differ; 2 an error (a path that is not a checkpoint, a damaged checkpoint, a bad argument: a
CheckpointError such as DiffError, one line on stderr).
"""


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def add_parser(commands) -> None:
    p = add_command(
        commands,
        "diff",
        help="compare two checkpoints tensor by tensor (any formats, any world sizes); exit 1 when they differ",
        description=DESCRIPTION,
    )
    p.add_argument(
        "a", metavar="A", help="a checkpoint (or a manager root: its latest step): path, file://, s3://, gs://, az://"
    )
    p.add_argument("b", metavar="B", help="the checkpoint (or manager root) to compare it with")
    p.add_argument("--atol", type=_tolerance, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=_tolerance, default=0.0, help="relative tolerance, times max(|a|, |b|) (default 0)")
    p.add_argument(
        "--equal-nan",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="NaN equals NaN (default); --no-equal-nan: a NaN differs even from itself",
    )
    p.add_argument(
        "--bitwise", action="store_true", help="elements are equal only when their bits are (-0.0 differs from 0.0)"
    )
    p.add_argument("--only", metavar="ENTRY", help="compare only the keys under this top-level entry, e.g. model")
    p.add_argument(
        "--show", type=int, default=20, metavar="N", help="list at most N differing tensors and keys (default 20)"
    )
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.add_argument("--trusted", action="store_true", help=TRUSTED_HELP)
    add_no_progress(p)
    p.set_defaults(func=run, error_exit=EXIT_USAGE)


def _listed(names: list[str], show: int) -> str:
    more = f" ... and {len(names) - show} more" if len(names) > show else ""
    return ", ".join(names[:show]) + more


def _side(doc: dict) -> str:
    parts = [doc["format"]]
    if doc["step"] is not None:
        parts.append(f"step {doc['step']}")
    if doc["world_size"] is not None:
        parts.append(f"saved by {doc['world_size']} rank{'s' if doc['world_size'] != 1 else ''}")
    return f"{doc['uri']} ({', '.join(parts)})"


def render(report, show: int = 20) -> str:
    """The text report (what `ckpt diff` prints without --json)."""
    lines = [f"A: {_side(report.a)}", f"B: {_side(report.b)}"]
    if report.only_in_a:
        lines.append(f"only in A ({len(report.only_in_a)}): {_listed(report.only_in_a, show)}")
    if report.only_in_b:
        lines.append(f"only in B ({len(report.only_in_b)}): {_listed(report.only_in_b, show)}")
    for item in report.mismatched[:show]:
        a, b = item["a"], item["b"]
        what = lambda d: d.get("kind") or f"{d['dtype']}{tuple(d['shape'])}"  # noqa: E731
        lines.append(f"differs in shape or kind: {item['key']}: {what(a)} vs {what(b)}")
    differing = [t for t in report.tensors if not t.within_tolerance]
    for t in differing[:show]:
        where = "" if t.worst_index is None else f" at {t.worst_index} (A {t.worst_a!r}, B {t.worst_b!r})"
        dtype = f" dtype {t.dtype_a} vs {t.dtype_b};" if t.dtype_a != t.dtype_b else ""
        gap = str(t.max_abs_diff) if isinstance(t.max_abs_diff, int) else f"{t.max_abs_diff:.6g}"  # ints exact
        lines.append(
            f"differs: {t.key}:{dtype} {t.mismatched} of {t.numel} elements beyond tolerance; max abs diff "
            f"{gap}{where}; max rel diff {t.max_rel_diff:.6g}"
        )
    if len(differing) > show:
        lines.append(f"... and {len(differing) - show} more differing tensors")
    for item in [o for o in report.objects if not o["equal"]][:show]:
        lines.append(f"differs: {item['key']}: {item['a']} vs {item['b']}")
    s = report.summary()
    lines.append(
        f"{s['tensors']} tensors compared: {s['bit_identical']} bit-identical, {s['within_tolerance']} equal within "
        f"atol={report.atol:g} rtol={report.rtol:g}, {s['different']} different; {s['shape_or_dtype_mismatch']} "
        f"shape/kind mismatches; {s['only_in_a']} keys only in A, {s['only_in_b']} only in B; {s['objects']} other "
        f"entries, {s['objects_different']} different"
    )
    lines.append("EQUAL" if report.equal else "DIFFERENT")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ckptlib.offline.diff import diff_checkpoints

    args.a, args.b = resolve_arg(args, args.a).uri, resolve_arg(args, args.b).uri
    with progress_bar(args, "ckpt diff") as bar:

        def on_start(total: int) -> None:
            bar.total = total
            bar.refresh()

        def on_tensor(key: str, nbytes: int) -> None:
            bar.set_postfix_str(key[-40:], refresh=False)

        report = diff_checkpoints(
            args.a,
            args.b,
            atol=args.atol,
            rtol=args.rtol,
            equal_nan=args.equal_nan,
            bitwise=args.bitwise,
            only=args.only,
            trusted=args.trusted,
            on_start=on_start,
            on_tensor=on_tensor,
            on_bytes=bar.update,
        )
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(render(report, max(args.show, 0)))
    return EXIT_OK if report.equal else EXIT_FAIL
