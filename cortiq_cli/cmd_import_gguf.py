"""``cortiq import-gguf FILE.gguf OUT_DIR``: a GGUF file -> an HF checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cortiq_cli.common import console, err_console, handle_errors, human_bytes, print_json, print_table
from cortiq_engine.convert import gguf_architectures, import_gguf as run_import
from formats.gguf_import import OUT_DTYPES, ImportReport


@handle_errors
def import_gguf(
    file: Path = typer.Argument(..., help=f"The .gguf file ({', '.join(gguf_architectures())})."),
    out_dir: Path = typer.Argument(..., help="Folder to create: config.json, model.safetensors, tokenizer files."),
    dtype: str = typer.Option("f32", "--dtype", help=f"Weight dtype in model.safetensors: {', '.join(OUT_DTYPES)}."),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON report on stdout instead of tables."),
) -> None:
    """Dequantize a GGUF into a checkpoint folder transformers can load ([bold]cortiq convert[/] reads the .gguf itself)."""
    if json_out:
        report = run_import(file, out_dir, dtype=dtype, force=force)
        print_json(report.to_json())
        return
    bar = Progress(
        TextColumn("[bold]importing[/]"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # redirected, rich would leave a blank line
    )
    task = bar.add_task("", total=None)

    def progress(name: str, done: int, total: int) -> None:
        if not bar.live.is_started:  # started late so an early error stays one clean line
            bar.start()
        bar.update(task, completed=done, total=total, description=name)

    try:
        report = run_import(file, out_dir, dtype=dtype, force=force, progress=progress)
    finally:
        if bar.live.is_started:
            bar.stop()
    _render(report)


def _render(r: ImportReport) -> None:
    t = Table(title=f"import-gguf -> {r.output}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{r.name or '?'} ({r.architecture} -> {r.model_type})")
    t.add_row("parameters", f"{r.params / 1e6:,.1f} M in {r.tensors} tensors")
    t.add_row("GGUF types", ", ".join(f"{k} x{v}" for k, v in sorted(r.gguf_types.items())))
    t.add_row("written as", f"{r.dtype}{', tied embeddings' if r.tied_embeddings else ''}")
    t.add_row(
        "tokenizer", f"{r.vocab_size:,} tokens, {r.merges:,} merges, {r.special_tokens} special, pre={r.pre_tokenizer}"
    )
    t.add_row("chat template", "yes" if r.chat_template else "no")
    t.add_row("size", f"{human_bytes(r.source_bytes)} -> {human_bytes(r.output_bytes)}")
    t.add_row("time", f"{r.seconds:.1f} s")
    print_table(console, t)
    for w in r.warnings:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
