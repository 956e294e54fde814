"""``cortiq ppl``: perplexity of one or more models on one text, and how the others drift from the first."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from cortiq_cli import text_options as opt
from cortiq_cli.common import console, err_console, handle_errors, print_json, print_table
from evals.perplexity import Comparison, PerplexityAccumulator, PerplexityReport, PerplexityResult, build_reports
from evals.scoring import ScoredBlock, count_scored, iter_scored, scored_text_bytes
from evals.text_source import LoadedText, load_text
from evals.tokens import chunk_bos, tokenize_for
from evals.windows import Window, chunk_windows, sliding_windows
from formats.errors import CortiqError
from formats.untrusted_json import section

MODES = ("sliding", "chunks")


def load_engines(paths: list[Path], threads: int | None, ctx: int) -> list[Any]:
    from cortiq_engine import Engine

    return [Engine.load(p, threads=threads, ctx=ctx) for p in paths]


def model_label(path: Path, engine: Any) -> str:
    quant = section(getattr(engine, "header", None) or {}, "quant").get("default")
    return f"{path.name} ({quant})" if quant else path.name


def plan_windows(mode: str, n_tokens: int, ctx: int, stride: int | None, max_tokens: int | None,
                 chunks: int | None, bos: int | None) -> list[Window]:
    if mode == "sliding":
        if chunks is not None:
            raise CortiqError("--chunks applies to --mode chunks")
        return sliding_windows(n_tokens, ctx, stride if stride is not None else max(1, ctx // 2), max_tokens)
    if mode == "chunks":
        if stride is not None:
            raise CortiqError("--stride applies to --mode sliding; chunks never overlap")
        return chunk_windows(n_tokens, ctx, bos=bos, max_scored=max_tokens, max_chunks=chunks)
    raise CortiqError(f"unknown --mode {mode!r}; choose one of {', '.join(MODES)}")


@handle_errors
def ppl(
    models: Annotated[list[Path], typer.Argument(help="CMF model files; the first is the reference for comparisons.", show_default=False)],
    text: opt.TextFile = None,
    dataset: opt.Dataset = None,
    config: opt.Config = None,
    split: opt.Split = None,
    column: opt.Column = None,
    data_files: opt.DataFiles = None,
    max_tokens: opt.MaxTokens = None,
    ctx: opt.Ctx = 512,
    stride: opt.Stride = None,
    mode: Annotated[str, typer.Option("--mode", help="sliding (HF guide) or chunks (llama.cpp: disjoint ctx windows, second half scored).", rich_help_panel=opt.WINDOW_PANEL)] = "sliding",
    chunks: Annotated[int | None, typer.Option("--chunks", min=1, help="chunks mode: score at most this many chunks (llama.cpp --chunks).", rich_help_panel=opt.WINDOW_PANEL)] = None,
    batch: opt.BlockRows = 128,
    threads: opt.Threads = None,
    json_out: opt.Json = False,
) -> None:
    """Perplexity, NLL with its standard error, bits per byte; with several models, KL and top-1 agreement against the first."""
    source = load_text(opt.text_spec(text, dataset, config, split, column, data_files))
    engines = load_engines(models, threads, ctx)
    names = [model_label(p, e) for p, e in zip(models, engines)]
    tokens = tokenize_for(engines, names, source.text)
    windows = plan_windows(mode, len(tokens), ctx, stride, max_tokens, chunks, chunk_bos(engines[0].tokenizer))
    if not windows:
        raise CortiqError("nothing to score: the window plan is empty")
    total = sum(w.n_scored for w in windows)

    if json_out:
        result, done = score_partial(engines, names, tokens, windows, engines[0].tokenizer, chunk=batch)
    else:
        with Progress(
            TextColumn("[bold]scoring[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens  ppl [cyan]{task.fields[ppl]}[/]"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
            disable=not err_console.is_terminal,  # no stray output into logs or captured stderr
        ) as bar:
            task = bar.add_task("ppl", total=total, ppl="-")

            def progress(done: int, _total: int, running: float) -> None:
                bar.update(task, completed=done, ppl=f"{running:.4f}")

            result, done = score_partial(engines, names, tokens, windows, engines[0].tokenizer, chunk=batch, progress=progress)

    settings = {
        "mode": mode,
        "ctx": ctx,
        "stride": (stride if stride is not None else max(1, ctx // 2)) if mode == "sliding" else None,
        "windows": len(windows),
        "chunk_bos": windows[0].bos if mode == "chunks" else None,
        "max_tokens": max_tokens,
        "text_tokens": int(len(tokens)),
        # only after a Ctrl-C: the figures cover the first windows_done windows
        **({"partial": True, "windows_done": done} if done < len(windows) else {}),
    }
    if json_out:
        print_json(to_json(source, settings, result, models))
    else:
        render(source, settings, result)
    if done < len(windows):
        interrupted(done, len(windows))


def interrupted(done: int, total: int) -> None:
    """After printing the figures over the windows scored before Ctrl-C: say so, exit 130."""
    err_console.print(f"[bold red]interrupted[/]: figures above are partial, over {done} of {total} windows", highlight=False)
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


def score_partial(
    engines: list[Any], names: list[str], tokens: Any, windows: list[Window], decoder: Any, chunk: int,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[PerplexityResult, int]:
    """``run_perplexity`` that, on Ctrl-C, returns the figures over the windows done so far
    (and how many); with none done the interrupt goes on up."""
    acc = PerplexityAccumulator(len(engines))
    total, done = count_scored(windows), 0
    try:
        for group in whole_windows(iter_scored(engines, tokens, windows, chunk=chunk), windows):
            for block in group:
                acc.add(block)
            done = group[0].window + 1
            if progress:
                progress(acc.count, total, acc.running_ppl)
    except KeyboardInterrupt:
        if not acc.count:
            raise
    reports, comps = build_reports(acc, names, scored_text_bytes(decoder, tokens, windows[:done]))
    return PerplexityResult(reports, comps), done


def to_json(source: LoadedText, settings: dict[str, Any], result: PerplexityResult, paths: list[Path]) -> dict[str, Any]:
    return {
        "text": {"source": source.source, "documents": source.documents, "bytes": source.n_bytes},
        "settings": settings,
        "models": [dict(r.to_json(), path=str(p)) for r, p in zip(result.reports, paths)],
        "comparisons": [c.to_json() for c in result.comparisons],
    }


def render(source: LoadedText, settings: dict[str, Any], result: PerplexityResult) -> None:
    how = f"{settings['mode']}, ctx {settings['ctx']}"
    if settings["stride"] is not None:
        how += f", stride {settings['stride']}"
    r0 = result.reports[0]
    console.print(
        f"[bold]text[/] {source.source}\n"
        f"  {source.n_bytes:,} bytes, {settings['text_tokens']:,} tokens; scored {r0.tokens_scored:,} tokens "
        f"({r0.bytes_scored:,} bytes) in {settings['windows']} windows ({how})"
        + (f" [bold red]partial[/]: {settings['windows_done']} of {settings['windows']} windows done" if settings.get("partial") else ""),
        highlight=False,
    )
    print_table(console, _ppl_table(result.reports))
    if result.comparisons:
        print_table(console, _comparison_table(result.comparisons))


def _num(x: float, digits: int = 4) -> str:
    """Fixed point, or scientific for values too small to show that way (KL of near-identical models)."""
    if x != 0 and abs(x) < 10 ** -(digits - 1):
        return f"{x:.2e}"
    return f"{x:.{digits}f}"


def _ppl_table(reports: list[PerplexityReport]) -> Table:
    t = Table(title="Perplexity", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("model", style="bold", overflow="fold", min_width=12)
    t.add_column("ppl", justify="right", style="cyan", no_wrap=True)
    t.add_column("95% CI", justify="right", no_wrap=True)
    t.add_column("NLL ± SE", justify="right", no_wrap=True)
    t.add_column("bits/byte", justify="right", no_wrap=True)
    for r in reports:
        lo, hi = r.ppl_ci95
        spread = math.isfinite(lo) and math.isfinite(hi)  # one scored token has no spread
        t.add_row(
            r.model,
            f"{r.ppl:.4f}",
            f"{lo:.3f}–{hi:.3f}" if spread else f"n/a ({r.tokens_scored} token)",
            f"{r.nll.mean:.4f} ± {r.nll.se:.4f}" if spread else f"{r.nll.mean:.4f} ± n/a",
            f"{r.bits_per_byte:.4f}",
        )
    return t


def _comparison_table(comps: list[Comparison]) -> Table:
    t = Table(title=f"Against {comps[0].reference}", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("model", style="bold", overflow="fold", min_width=12)
    t.add_column("ppl ratio", justify="right", style="cyan", no_wrap=True)
    t.add_column("95% CI", justify="right", no_wrap=True)
    t.add_column("mean KL", justify="right", no_wrap=True)
    t.add_column("KL max", justify="right", no_wrap=True)
    t.add_column("top-1 agree", justify="right", no_wrap=True)
    for c in comps:
        lo, hi = c.ppl_ratio_ci95
        t.add_row(
            c.model,
            f"{c.ppl_ratio:.4f}",
            f"{lo:.4f}–{hi:.4f}",
            _num(c.kl.mean),
            _num(c.kl_quantiles.get("max", float("nan"))),
            f"{100 * c.top1.mean:.2f}%",
        )
    return t
