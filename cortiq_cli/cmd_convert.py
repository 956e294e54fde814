"""``cortiq convert``: an HF checkpoint, hub repo id or GGUF file -> one CMF file."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from cortiq_cli.common import (
    BytesColumn,
    console,
    err_console,
    handle_errors,
    human_bytes,
    mib_per_s,
    print_json,
    print_table,
    quant_names_help,
    resolve_quant,
)
from formats.convert import MTP_MODES, ConvertReport, QuantPolicy
from formats.policy import quant_help


def convert_checkpoint(src, out, **kw) -> ConvertReport:
    """``cortiq_engine.convert.convert_checkpoint`` (the architecture families name and
    check the tensors), imported on use so the CLI starts without the engine."""
    from cortiq_engine.convert import convert_checkpoint as run

    return run(src, out, **kw)


@handle_errors
def convert(
    src: str = typer.Argument(..., help="HF checkpoint folder, hub repo id (org/name) or .gguf file."),
    out: Path = typer.Argument(..., help="Output .cmf file."),
    quant: str = typer.Option(
        "q8_0",
        "--quant",
        "-q",
        metavar="TYPE",
        help=f"Quantization, as llama.cpp names it (cortiq's short name in brackets): {quant_names_help()}, or keep: the source's blocks where CMF has them. The presets (b/w = bits per weight): {quant_help()}.",
    ),
    keep: list[str] = typer.Option(
        [],
        "--keep",
        metavar="PATTERN=DTYPE",
        help="Dtype override on CMF tensor names (fnmatch; repeatable; llama.cpp's type names too), e.g. 'lm_head.weight=f16'.",
    ),
    mtp: str = typer.Option(
        "sidecar", "--mtp", metavar="|".join(MTP_MODES), help="MTP draft layers (sidecar = OUT.mtp.cmf)."
    ),
    force: bool = typer.Option(False, "--force", "-f", help="Overwrite OUT (and its sidecar) if they exist."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    imatrix: Path = typer.Option(
        None,
        "--imatrix",
        help="Importance matrix from `cortiq imatrix`: the K-quant encoders minimize the activation-weighted error.",
    ),
) -> None:
    """Convert a checkpoint into a CMF file, one tensor at a time."""
    quant = resolve_quant(quant)
    keep_pairs = QuantPolicy.parse_keep(keep)  # a dtype as llama.cpp spells it (q8_0) reads as cortiq's
    if json_out:
        report = convert_checkpoint(src, out, quant=quant, keep=keep_pairs, mtp=mtp, force=force, imatrix=imatrix)
        print_json(report.to_json())
        return
    with Progress(
        TextColumn("[bold]{task.description}", justify="left"),
        BarColumn(),
        BytesColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[tensor]}", style="dim"),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # redirected, rich would leave a blank line
    ) as bar:
        task = bar.add_task("converting", total=None, tensor="")

        def on_progress(name: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, tensor=name)

        report = convert_checkpoint(
            src, out, quant=quant, keep=keep_pairs, mtp=mtp, force=force, progress=on_progress, imatrix=imatrix
        )
    _render(report)


def _render(r: ConvertReport) -> None:
    t = Table(title=f"{r.output}  ({r.arch.arch}, {human_bytes(r.output_bytes)})", title_justify="left")
    t.add_column("dtype")
    t.add_column("tensors", justify="right")
    t.add_column("params", justify="right")
    t.add_column("bytes", justify="right")
    t.add_column("RMS rel. error", justify="right")
    for name in sorted(r.by_dtype, key=lambda k: -r.by_dtype[k].bytes):
        s = r.by_dtype[name]
        t.add_row(name, str(s.tensors), f"{s.params:,}", human_bytes(s.bytes), f"{100 * s.rms_rel_error:.3f}%")
    print_table(console, t)
    console.print(
        f"{human_bytes(r.source_bytes)} read in {r.seconds:.1f} s ({mib_per_s(r.source_bytes, r.seconds)}) from {r.source}",
        highlight=False,
    )
    if r.sidecar:
        console.print(f"MTP sidecar: {r.sidecar} ({r.mtp_tensors} tensors)", highlight=False)
    elif r.mtp_tensors and r.arch.mtp is not None:
        where = "kept inline" if any(t.file == "main" and ".mtp." in t.name for t in r.tensors) else "dropped"
        console.print(f"MTP layers: {r.mtp_tensors} tensors {where}", highlight=False)
    if r.fallbacks:
        console.print(
            f"[yellow]{len(r.fallbacks)} tensor(s) could not take the quantized dtype (last dim not a multiple of 32) "
            f"and are f16:[/] {', '.join(r.fallbacks[:5])}{' ...' if len(r.fallbacks) > 5 else ''}",
            highlight=False,
        )
    for spec in r.unused_keep:
        console.print(f"[yellow]--keep {spec} matched no matrix[/]", highlight=False)
