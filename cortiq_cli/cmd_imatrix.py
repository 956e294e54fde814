"""``cortiq imatrix``: per-input-column activation energy of every weight over real text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cortiq_cli import cluster_options as copt
from cortiq_cli import text_options as opt
from cortiq_cli.common import console, err_console, handle_errors, print_json
from evals.text_source import load_text
from evals.tokens import chunk_bos, tokenize_for
from evals.windows import DEFAULT_CTX, plan_windows, resolve_settings
from formats.errors import CortiqError
from formats.imatrix import write_imatrix


@handle_errors
def imatrix(
    model: Path = typer.Argument(
        ..., help="CMF model to run (f32 or a high-precision type gives the truest activations)."
    ),
    out: Annotated[
        Optional[Path],
        typer.Option("--out", "-o", help="Output file (safetensors; default MODEL.imatrix.safetensors)."),
    ] = None,
    text: opt.TextFile = None,
    dataset: opt.Dataset = None,
    config: opt.Config = None,
    split: opt.Split = None,
    column: opt.Column = None,
    data_files: opt.DataFiles = None,
    max_tokens: opt.MaxTokens = None,
    ctx: opt.Ctx = DEFAULT_CTX,
    stride: opt.Stride = None,
    mode: opt.Mode = None,
    chunks: opt.Chunks = None,
    threads: opt.Threads = None,
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
    json_out: opt.Json = False,
    cluster: copt.Cluster = None,
    cluster_threads: copt.ClusterThreads = None,
    resume: copt.Resume = False,
) -> None:
    """Collect an importance matrix for ``cortiq convert --imatrix``: for every weight, the
    mean squared input activation of each column over every token the windows feed (the
    windows ppl scores: by default llama.cpp's chunks, as llama-imatrix)."""
    from cortiq_engine import Engine
    from cortiq_engine.imatrix import collect_imatrix

    settings = resolve_settings(mode, ctx, stride, max_tokens, chunks)
    where = copt.check(cluster, resume)
    out = out or model.with_name(model.stem + ".imatrix.safetensors")
    if out.exists() and not force:
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    source = load_text(opt.text_spec(text, dataset, config, split, column, data_files))
    with Engine.load(model, threads=threads, ctx=ctx, warmup=False) as eng:
        ids = tokenize_for([eng], [model.name], source.text)
        bos = chunk_bos(eng.tokenizer)
        engine_threads = eng.threads
    plan = plan_windows(settings, len(ids), bos)
    windows = [w.fed(ids) for w in plan]
    total = sum(len(w) for w in windows)
    creport = None
    if where is not None:
        acc, done, creport = copt.collect_imatrix(
            where, cluster_threads or engine_threads, resume, not json_out, model, ids, plan
        )
        if done < len(plan):  # never write an imatrix of part of the text
            copt.note_interrupted()
            raise KeyboardInterrupt
        means, tokens = acc.means(), acc.tokens
    elif json_out or not err_console.is_terminal:
        means, tokens = collect_imatrix(model, windows, threads=threads)
    else:
        with Progress(
            TextColumn("[bold]collecting[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
            transient=True,
        ) as bar:
            task = bar.add_task("imatrix", total=total)
            means, tokens = collect_imatrix(model, windows, threads=threads, progress=lambda n: bar.advance(task, n))
    write_imatrix(out, means, tokens)
    report = {
        "output": str(out),
        "tokens": tokens,
        "tensors": len(means),
        "source": source.source,
        **({"cluster": creport.to_json()} if creport is not None else {}),
    }
    if json_out:
        print_json(report)
    else:
        console.print(f"{out}: {len(means)} weights, {tokens:,} tokens from {source.source}", highlight=False)
        if creport is not None:
            copt.render_report(creport)
