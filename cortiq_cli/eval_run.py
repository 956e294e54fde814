"""What the eval commands (``ppl``, ``calibrate``, ``imatrix``, ``quant-sweep``, ``mtp-probe``)
share in the terminal: the progress bars their evals run reports to, and the Ctrl-C exit."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cortiq_cli.common import err_console
from cortiq_cli.text_options import ClusterArgs
from evals.cluster import ClusterAddress, ClusterProgress
from evals.runs import ClusterRun, ScoreProgress


def interrupted(done: int, total: int) -> None:
    """After printing the figures over the windows scored before Ctrl-C: say so, exit 130."""
    err_console.print(
        f"[bold red]interrupted[/]: figures above are partial, over {done} of {total} windows", highlight=False
    )
    raise typer.Exit(130)


def progress_bar(label: str, *fields: str, eta: bool = True) -> Progress:
    """A transient stderr bar: ``label``, the bar, done/total, the ``fields`` (rich markup
    reading ``task.fields``), elapsed and (with ``eta``) remaining time."""
    columns = [TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn()]
    columns += [TextColumn(f) for f in fields]
    columns += [TimeElapsedColumn()] + ([TimeRemainingColumn()] if eta else [])
    # no stray output into logs or captured stderr
    return Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal)


def scoring_progress(label: str, field: str) -> Progress:
    """The bar of a scoring pass; ``field`` names the running figure."""
    return progress_bar(label, f"tokens  {field} [cyan]{{task.fields[value]}}[/]")


class _Bar:
    """A bar shown from its first update (not while the models load) until the block ends."""

    def __init__(self, make: Any, **fields: str):
        self.make, self.fields = make, fields
        self.bar: Progress | None = None
        self.task: Any = None

    def update(self, **kw: Any) -> None:
        if self.bar is None:
            self.bar = self.make()
            self.task = self.bar.add_task("run", total=kw.get("total"), **self.fields)
            self.bar.update(self.task, **kw)  # the first frame shows the first figures
            self.bar.start()
            return
        self.bar.update(self.task, **kw)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@contextmanager
def _shown(bar: _Bar, callback: Any) -> Iterator[Any]:
    try:
        yield callback
    finally:
        bar.stop()


def cluster_bar() -> Any:
    """The bar over every worker of a cluster run (windows done, tokens per second, time
    left), and its ``ClusterProgress`` callback."""
    bar = _Bar(lambda: progress_bar("cluster", "windows  [cyan]{task.fields[rate]}[/] tok/s"), rate="-")

    def update(done: int, windows: int, _tokens: int, _total: int, rate: float) -> None:
        bar.update(completed=done, total=windows, rate=f"{rate:,.0f}" if rate == rate else "-")

    return _shown(bar, update)


@contextmanager
def scoring_bars(
    quiet: bool, on_cluster: bool, field: str, fmt: str = ".4f"
) -> Iterator[tuple[ScoreProgress | None, ClusterProgress | None]]:
    """The callbacks an evals run reports its scoring to: (one process's, a cluster's);
    None where nothing is shown (``quiet``: --json)."""
    if quiet:
        yield None, None
    elif on_cluster:
        with cluster_bar() as cluster:
            yield None, cluster
    else:
        bar = _Bar(lambda: scoring_progress("scoring", field), value="-")

        def local(done: int, total: int, running: float) -> None:
            bar.update(completed=done, total=total, value=format(running, fmt))

        with _shown(bar, local) as update:
            yield update, None


@contextmanager
def sweep_bar(quiet: bool) -> Iterator[Any]:
    """quant-sweep's bar: the type being scored, its tokens done out of its total."""
    if quiet:
        yield None
        return
    bar = _Bar(lambda: scoring_progress("scoring", "type"), value="-")

    def update(kind: str, done: int, total: int) -> None:
        bar.update(completed=done, total=total, value=kind)

    with _shown(bar, update) as progress:
        yield progress


def counting_bar(label: str, *fields: str, eta: bool = True) -> Any:
    """A bar of things done out of a total, and its ``(done, total)`` callback."""
    bar = _Bar(lambda: progress_bar(label, *fields, eta=eta))

    def update(done: int, total: int) -> None:
        bar.update(completed=done, total=total)

    return _shown(bar, update)


def cluster_run(where: ClusterAddress | None, opts: ClusterArgs, progress: ClusterProgress | None) -> ClusterRun | None:
    return None if where is None else ClusterRun(where, opts.cluster_threads, opts.resume, progress)
