"""`ckpt bench --plot`: save and load throughput against world size, one column per state size
(needs matplotlib: `pip install 'ckptlib[bench]'`)."""

from __future__ import annotations

from typing import Any


def _panel(ax, ws: list[int], rows: list[dict[str, Any]], title: str, series, one_rank: tuple[str, str]) -> None:
    """One plot panel: MiB/s against world size for each (key, label, style) in `series`,
    plus the single-rank baseline `one_rank` (key, label) as a cross where it was measured."""
    for key, label, style in series:
        ax.plot(ws, [r[key] for r in rows], style, label=label)
    single = [r[one_rank[0]] for r in rows if r["world"] == 1]
    if single and single[0] == single[0]:
        ax.plot([1], single, "kx", label=one_rank[1])
    ax.set_title(title)
    ax.set_xlabel("world size")
    ax.set_ylabel("MiB/s")
    ax.set_xticks(ws)
    ax.legend(fontsize=7)


def plot(results: dict[str, Any], summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size_mib"] for r in summary["save"]})
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.5 * len(sizes), 7), squeeze=False)
    for col, size in enumerate(sizes):
        rows = [r for r in summary["save"] if r["size_mib"] == size]
        ws = [r["world"] for r in rows]
        _panel(
            axes[0][col],
            ws,
            rows,
            f"save, {size} MiB",
            (("ckptlib", "ckptlib", "o-"), ("dcp", "raw DCP", "s--"), ("raw", "raw write+fsync", "^:")),
            ("torch", "torch.save (1 rank)"),
        )
        lrows = [r for r in summary["load"] if r["size_mib"] == size]
        _panel(
            axes[1][col],
            ws,
            lrows,
            f"load (page cache), {size} MiB",
            (
                ("ckptlib_verify_warm", "ckptlib (verify)", "o-"),
                ("ckptlib_noverify_warm", "ckptlib (no verify)", "o:"),
                ("dcp_warm", "raw DCP", "s--"),
            ),
            ("torch_warm", "torch.load (1 rank)"),
        )
    fig.suptitle("ckptlib vs baselines (2-core box: compare within a panel, not across runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
