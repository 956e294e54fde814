"""What the eval commands (``ppl``, ``calibrate``, ``quant-sweep``) share: loading the
models, labelling them, grouping scored blocks into whole windows, the progress bar
and the Ctrl-C exit."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cortiq_cli.common import err_console
from evals.scoring import ScoredBlock
from evals.windows import Window
from formats.untrusted_json import section


def load_engines(paths: list[Path], threads: int | None, ctx: int, kv_cache: str = "f32") -> list[Any]:
    from cortiq_engine import Engine

    return [Engine.load(p, threads=threads, ctx=ctx, kv_cache=kv_cache) for p in paths]


def model_label(path: Path, engine: Any) -> str:
    quant = section(getattr(engine, "header", None) or {}, "quant").get("default")
    return f"{path.name} ({quant})" if quant else path.name


def interrupted(done: int, total: int) -> None:
    """After printing the figures over the windows scored before Ctrl-C: say so, exit 130."""
    err_console.print(
        f"[bold red]interrupted[/]: figures above are partial, over {done} of {total} windows", highlight=False
    )
    raise typer.Exit(130)


def whole_windows(blocks: Iterator[ScoredBlock], windows: list[Window]) -> Iterator[list[ScoredBlock]]:
    """Group scored blocks by window, yielding a window as soon as all of its rows are
    scored (so a Ctrl-C leaves figures over whole windows)."""
    pending: list[ScoredBlock] = []
    rows = 0
    for b in blocks:
        if pending and b.window != pending[0].window:  # not expected: iter_scored gives every row
            yield pending
            pending, rows = [], 0
        pending.append(b)
        rows += len(b.targets)
        if rows >= windows[b.window].n_scored:
            yield pending
            pending, rows = [], 0


def scoring_progress(label: str, field: str) -> Progress:
    """The transient stderr bar of a scoring pass; ``field`` names the running figure."""
    return Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"tokens  {field} [cyan]{{task.fields[value]}}[/]"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # no stray output into logs or captured stderr
    )
