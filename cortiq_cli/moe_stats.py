"""``cortiq generate --moe-stats``: how often each expert of each MoE layer was chosen."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from cortiq_cli.common import print_table
from formats.arch import ArchConfig

# Up to this many experts the table has one column per expert; beyond, a summary.
WIDE_LIMIT = 16
TOP_SHOWN = 8


def moe_stats_json(usage: dict[int, list[int]] | None, arch: ArchConfig) -> dict[str, Any] | None:
    """The ``moe_stats`` JSON object, or None for a model without MoE layers."""
    if arch.moe is None or not usage:
        return None
    return {
        "num_experts": arch.moe.num_experts,
        "top_k": arch.moe.top_k,
        "layers": [
            {"layer": int(layer), "counts": [int(c) for c in counts]} for layer, counts in sorted(usage.items())
        ],
    }


def print_moe_stats(console: Console, stats: dict[str, Any] | None) -> None:
    if not stats:
        console.print("[dim]no MoE layers: no expert statistics[/]")
        return
    n = stats["num_experts"]
    table = Table(title=f"Expert choices per layer (top-{stats['top_k']} of {n})", title_justify="left")
    table.add_column("layer", justify="right")
    if n <= WIDE_LIMIT:
        for e in range(n):
            table.add_column(str(e), justify="right")
        for row in stats["layers"]:
            counts = row["counts"]
            hi = max(counts)
            cells = [f"[bold]{c}[/]" if c == hi and c else (f"[dim]{c}[/]" if c == 0 else str(c)) for c in counts]
            table.add_row(str(row["layer"]), *cells)
    else:
        table.add_column("choices", justify="right")
        table.add_column("experts used", justify="right")
        table.add_column("busiest share", justify="right")
        table.add_column(f"top {TOP_SHOWN} (expert×count)")
        for row in stats["layers"]:
            counts = row["counts"]
            total = sum(counts)
            top = sorted(range(n), key=lambda e: (-counts[e], e))[:TOP_SHOWN]
            table.add_row(
                str(row["layer"]),
                str(total),
                f"{sum(1 for c in counts if c)}/{n}",
                f"{max(counts) / total:.1%}" if total else "-",
                " ".join(f"{e}×{counts[e]}" for e in top if counts[e]),
            )
    print_table(console, table)
