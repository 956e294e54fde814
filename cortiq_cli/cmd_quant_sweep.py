"""``cortiq quant-sweep``: convert a source to each quantization type, score each against
the f32 reference on the same windows, time its decode, and print one table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from cortiq_cli import cluster_options as copt
from cortiq_cli import text_options as opt
from cortiq_cli.options import option_groups
from cortiq_cli.common import (
    check_plot,
    console,
    err_console,
    handle_errors,
    human_bytes,
    print_json,
    print_table,
    resolve_quant,
)
from cortiq_cli.eval_run import cluster_bar, cluster_run, sweep_bar
from evals.runs import ClusterInterrupted, SweepRequest, run_quant_sweep
from evals.sweep import SweepResult, parse_types
from evals.windows import DEFAULT_CTX
from formats.errors import CortiqError

SWEEP_PANEL = "Sweep"


@handle_errors
@option_groups
def quant_sweep(
    src: Annotated[
        str,
        typer.Argument(
            help="HF checkpoint folder, hub repo id, .gguf or .cmf file (as for convert).", show_default=False
        ),
    ],
    types: Annotated[
        str,
        typer.Option(
            "--types",
            metavar="TYPE,...",
            help="Comma-separated --quant types to try (any type convert accepts, llama.cpp's names or cortiq's), e.g. q8_0,q4_k_m,q4_0.",
            rich_help_panel=SWEEP_PANEL,
        ),
    ] = "q8_0,q4_1",
    text_opts: opt.BoundedTextArgs = opt.BoundedTextArgs(),
    ctx: Annotated[
        int, typer.Option("--ctx", "-c", min=4, help="Tokens per forward window.", rich_help_panel=opt.WINDOW_PANEL)
    ] = DEFAULT_CTX,
    window_opts: opt.WindowArgs = opt.WindowArgs(),
    top_k: Annotated[
        int,
        typer.Option(
            "--ref-top-k",
            min=1,
            help="Reference log-probabilities kept per position (docs/evals.md: the error this leaves).",
            rich_help_panel=SWEEP_PANEL,
        ),
    ] = 64,
    samples: Annotated[
        int,
        typer.Option(
            "--ref-samples",
            min=0,
            help="Reference tail tokens sampled per position (unbiased tail divergence).",
            rich_help_panel=SWEEP_PANEL,
        ),
    ] = 64,
    decode_tokens: Annotated[
        int,
        typer.Option(
            "--decode-tokens", min=1, help="Tokens per decode timing (llama-bench tg N).", rich_help_panel=SWEEP_PANEL
        ),
    ] = 64,
    decode_reps: Annotated[
        int,
        typer.Option(
            "--decode-reps", min=1, help="Decode timings per type (the median is shown).", rich_help_panel=SWEEP_PANEL
        ),
    ] = 3,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir",
            help="Folder for the converted files (default: a temporary folder, removed afterwards).",
            rich_help_panel=SWEEP_PANEL,
        ),
    ] = None,
    keep_files: Annotated[
        bool,
        typer.Option(
            "--keep-files",
            help="Keep the converted CMF files and the saved reference in --workdir.",
            rich_help_panel=SWEEP_PANEL,
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Draw bits/weight vs mean KLD and vs decode tok/s to this image (PNG, SVG or PDF; needs matplotlib).",
            rich_help_panel=SWEEP_PANEL,
        ),
    ] = None,
    batch: opt.BlockRows = 512,
    threads: opt.Threads = None,
    json_out: opt.Json = False,
    cluster_opts: opt.ClusterArgs = opt.ClusterArgs(),
) -> None:
    """Convert SRC to each --types quantization, score each against the f32 reference on the same windows, and time its decode."""
    kinds = parse_types(",".join(resolve_quant(t, option="--types") for t in types.split(",") if t.strip()) or types)
    request = SweepRequest(
        src,
        kinds,
        text_opts.spec(),
        window_opts.options(ctx, text_opts.max_tokens),
        top_k=top_k,
        samples=samples,
        decode_tokens=decode_tokens,
        decode_reps=decode_reps,
        workdir=workdir,
        keep_files=keep_files,
        batch=batch,
        threads=threads,
    )
    request.check()
    check_plot(plot)
    where = cluster_opts.where()

    def event(kind: str, info: dict[str, Any]) -> None:
        if kind in ("convert", "decode") and not json_out and err_console.is_terminal:
            err_console.print(f"[dim]{kind} {info['type']}[/]", highlight=False)

    try:
        if where is not None:  # a cluster run shows its bar over the workers
            with cluster_bar() as bar:
                run = run_quant_sweep(
                    request, event, cluster=cluster_run(where, cluster_opts, None if json_out else bar)
                )
        else:
            with sweep_bar(json_out) as progress:
                run = run_quant_sweep(request, event, progress)
    except ClusterInterrupted:  # no row of a type scored on part of the windows
        copt.note_interrupted()
        raise
    result, source, settings, creports = run.result, run.source, run.settings, run.cluster
    if plot is not None:
        draw(result, plot)
    if json_out:
        doc = result.to_json()
        doc["text"] = {"source": source.source, "bytes": source.n_bytes}
        doc["settings"] = settings.to_json()
        if creports:
            doc["settings"]["cluster"] = {kind: r.to_json() for kind, r in creports.items()}
        if plot is not None:
            doc["plot"] = str(plot)
        print_json(doc)
        return
    render(result, source.source, settings.to_json())
    for kind, creport in creports.items():
        console.print(f"{kind}: ", end="", highlight=False)
        copt.render_report(creport)
    if plot is not None:
        console.print(f"plot written to {plot}", highlight=False)


def render(r: SweepResult, text: str, settings: dict[str, Any]) -> None:
    how = f"{settings['mode']}, ctx {settings['ctx']}"
    console.print(
        f"[bold]{r.source}[/] against f32 (ppl {r.reference.ppl:.4f}) on {text}: {r.tokens_scored:,} tokens in "
        f"{r.windows} windows ({how}); reference kept as {r.reference_form} ({human_bytes(r.reference_bytes)})",
        highlight=False,
    )
    t = Table(title="Quantization sweep", title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (
        ("type", "left"),
        ("bits/weight", "right"),
        ("file", "right"),
        ("ppl ratio", "right"),
        ("95% CI", "right"),
        ("mean KLD", "right"),
        ("p99 KLD", "right"),
        ("same top-1", "right"),
        ("decode tok/s", "right"),
    ):
        t.add_column(name, justify=justify, no_wrap=True, style="bold" if name == "type" else None)
    for row in r.rows:
        c = row.comparison
        lo, hi = c.ppl_ratio_ci95
        t.add_row(
            row.quant,
            f"{row.bits_per_weight:.2f}",
            human_bytes(row.file_bytes),
            f"{c.ppl_ratio:.4f}",
            f"{lo:.4f}–{hi:.4f}" if math.isfinite(lo) and math.isfinite(hi) else "n/a",
            _sci(c.kl.mean) + (f" ± {_sci(c.kl.se)}" if math.isfinite(c.kl.se) and c.kl.mean > 0 else ""),
            _sci(c.kl_quantiles["p99"]),
            f"{100 * c.top1.mean:.2f}%",
            f"{row.decode_tok_s:.1f}" if row.decode_tok_s else "-",
        )
    print_table(console, t)


def _sci(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    return "0" if x == 0 else (f"{x:.4f}" if x >= 1e-3 else f"{x:.2e}")


def _label_offsets(points: list[tuple[float, float]], log: bool) -> list[tuple[int, int]]:
    """Text offsets (points) for the labels of ``points``: a label whose point sits
    within 0.3 bits/weight and a factor 1.6 (log axis) or 6% (linear) of an earlier
    label's point goes below it instead of above (q4km and q5km, 0.1 b/w apart)."""

    def close(p: tuple[float, float], q: tuple[float, float]) -> bool:
        (x, y), (x0, y0) = p, q
        near_y = max(y, y0) <= 1.6 * min(y, y0) if log else abs(y - y0) <= 0.06 * max(abs(y), abs(y0), 1e-30)
        return abs(x - x0) <= 0.3 and near_y

    return [(4, 4 - 12 * sum(close(p, q) for q in points[:i])) for i, p in enumerate(points)]


def draw(r: SweepResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in r.rows if row.comparison.kl.mean > 0]  # f32 has no point on a log KLD axis
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.scatter([x.bits_per_weight for x in rows], [x.comparison.kl.mean for x in rows])
    a.set_yscale("log")
    a.set_xlabel("bits per weight")
    a.set_ylabel("mean KLD vs f32 (nats/token)")
    pts = [(x.bits_per_weight, x.comparison.kl.mean) for x in rows]
    for x, p, off in zip(rows, pts, _label_offsets(pts, log=True)):
        a.annotate(x.quant, p, textcoords="offset points", xytext=off)
    speed = [x for x in r.rows if x.decode_tok_s]
    b.scatter([x.bits_per_weight for x in speed], [x.decode_tok_s for x in speed])
    b.set_xlabel("bits per weight")
    b.set_ylabel("decode tok/s")
    pts = [(x.bits_per_weight, x.decode_tok_s) for x in speed]
    for x, p, off in zip(speed, pts, _label_offsets(pts, log=False)):
        b.annotate(x.quant, p, textcoords="offset points", xytext=off)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    name = "/".join(Path(r.source).parts[-2:])  # a checkpoint folder is often just "hf" or "model"
    fig.suptitle(f"{name} against f32: {r.tokens_scored:,} tokens")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (ValueError, OSError) as e:
        raise CortiqError(f"--plot {path}: {str(e).splitlines()[0][:160]}") from None
    finally:
        plt.close(fig)
