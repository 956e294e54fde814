"""``cortiq ppl``: perplexity of one or more models on one text, and how the others drift
from the first (or from a reference saved with ``--save-ref``)."""

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
from cortiq_cli.common import console, err_console, handle_errors, human_bytes, print_json, print_table
from cortiq_cli.eval_run import cluster_run, interrupted, scoring_bars
from cortiq_cli.help import cortiq_version
from evals.perplexity import DP_QUANTILES, KLD_QUANTILES, Comparison, PerplexityReport, PerplexityResult
from evals.reference import DEFAULT_SAMPLES, DEFAULT_TOP_K
from evals.runs import PplRequest, run_ppl
from evals.text_source import LoadedText
from evals.windows import DEFAULT_CTX

REF_PANEL = "Reference"


@handle_errors
@option_groups
def ppl(
    models: Annotated[
        list[Path],
        typer.Argument(
            help="CMF model files; the first is the reference for comparisons (unless --ref).", show_default=False
        ),
    ],
    text_opts: opt.BoundedTextArgs = opt.BoundedTextArgs(),
    ctx: Annotated[
        int | None,
        typer.Option(
            "--ctx",
            "-c",
            min=2,
            help=f"Tokens per forward window (default {DEFAULT_CTX}, or the saved reference's).",
            rich_help_panel=opt.WINDOW_PANEL,
        ),
    ] = None,
    window_opts: opt.WindowArgs = opt.WindowArgs(),
    save_ref: Annotated[
        Path | None,
        typer.Option(
            "--save-ref",
            help="Save the first model's distributions to this .cref file, for later --ref comparisons.",
            rich_help_panel=REF_PANEL,
        ),
    ] = None,
    ref_top_k: Annotated[
        int,
        typer.Option(
            "--ref-top-k",
            min=0,
            help="With --save-ref: log-probabilities kept per position (0 = the whole vocabulary, exact but V x 4 bytes per token).",
            rich_help_panel=REF_PANEL,
        ),
    ] = DEFAULT_TOP_K,
    ref_samples: Annotated[
        int,
        typer.Option(
            "--ref-samples",
            min=0,
            help="With --save-ref: tail tokens sampled per position, for an unbiased estimate of the divergence outside the top-k (0: none; the KL is then a lower bound).",
            rich_help_panel=REF_PANEL,
        ),
    ] = DEFAULT_SAMPLES,
    ref: Annotated[
        Path | None,
        typer.Option(
            "--ref",
            help="Compare every model against this saved reference (.cref) instead of the first model; window options default to its own.",
            rich_help_panel=REF_PANEL,
        ),
    ] = None,
    engine_opts: opt.EngineArgs = opt.EngineArgs(),
    json_out: opt.Json = False,
    cluster_opts: opt.ClusterArgs = opt.ClusterArgs(),
) -> None:
    """Perplexity, NLL with its standard error, bits per byte; with several models (or --ref), llama.cpp's KL-divergence statistics against the reference."""
    request = PplRequest(
        models,
        text_opts.spec(),
        window_opts.options(ctx, text_opts.max_tokens),
        save_ref=save_ref,
        ref=ref,
        ref_top_k=ref_top_k,
        ref_samples=ref_samples,
        engine=engine_opts.options(),
    )
    request.check()
    where = cluster_opts.where()
    tool = f"cortiq ppl {cortiq_version()}"
    with scoring_bars(json_out, where is not None, "ppl") as (progress, cluster_progress):
        cluster = cluster_run(where, cluster_opts, cluster_progress)
        run = run_ppl(request, progress, cluster, tool)
    if json_out:
        print_json(run.to_json())
    else:
        render(run.source, run.info, run.result)
        if run.cluster is not None:
            copt.render_report(run.cluster)
    if run.partial:
        if save_ref is not None:
            err_console.print(f"[yellow]{save_ref} was not written (the pass did not finish)[/]", highlight=False)
        if run.cluster is not None:
            copt.note_interrupted()
        interrupted(run.done, run.windows)


def render(source: LoadedText, settings: dict[str, Any], result: PerplexityResult) -> None:
    how = f"{settings['mode']}, ctx {settings['ctx']}"
    if settings["stride"] is not None:
        how += f", stride {settings['stride']}"
    r0 = result.reports[0]
    console.print(
        f"[bold]text[/] {source.source}\n"
        f"  {source.n_bytes:,} bytes, {settings['text_tokens']:,} tokens; scored {r0.tokens_scored:,} tokens "
        f"({r0.bytes_scored:,} bytes) in {settings['windows']} windows ({how})"
        + (
            f" [bold red]partial[/]: {settings['windows_done']} of {settings['windows']} windows done"
            if settings.get("partial")
            else ""
        ),
        highlight=False,
    )
    print_table(console, _ppl_table(result.reports))
    if result.comparisons:
        print_table(console, _comparison_table(result.comparisons))
        print_table(console, _detail_table(result.comparisons))
    if "saved_ref" in settings:
        s = settings["saved_ref"]
        console.print(f"reference saved to {s['path']} ({s['form']}, {human_bytes(s['bytes'])})", highlight=False)


def _num(x: float, digits: int = 4) -> str:
    """Fixed point, or scientific for values too small to show that way (KL of near-identical models)."""
    if not math.isfinite(x):
        return "n/a"
    if x != 0 and abs(x) < 10 ** -(digits - 1):
        return f"{x:.2e}"
    return f"{x:.{digits}f}"


def _pm(mean: float, se: float, digits: int = 4) -> str:
    return f"{_num(mean, digits)} ± {_num(se, digits)}" if math.isfinite(se) else f"{_num(mean, digits)} ± n/a"


def _pct(x: float, digits: int = 3) -> str:
    return f"{100 * x:.{digits}f}%" if math.isfinite(x) else "n/a"


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
    form = comps[0].reference_form
    t = Table(
        title=f"Against {comps[0].reference}" + (f" ({form} saved reference)" if form != "full" else ""),
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    t.add_column("model", style="bold", overflow="fold", min_width=12)
    t.add_column("ppl ratio", justify="right", style="cyan", no_wrap=True)
    t.add_column("95% CI", justify="right", no_wrap=True)
    t.add_column("mean KLD ± SE", justify="right", no_wrap=True)
    t.add_column("p99 KLD", justify="right", no_wrap=True)
    t.add_column("KLD max", justify="right", no_wrap=True)
    t.add_column("reverse KLD", justify="right", no_wrap=True)
    t.add_column("same top-1", justify="right", no_wrap=True)
    t.add_column("RMS Δp", justify="right", no_wrap=True)
    for c in comps:
        lo, hi = c.ppl_ratio_ci95
        t.add_row(
            c.model,
            f"{c.ppl_ratio:.4f}",
            f"{lo:.4f}–{hi:.4f}" if math.isfinite(lo) and math.isfinite(hi) else "n/a",
            _pm(c.kl.mean, c.kl.se),
            _num(c.kl_quantiles["p99"]),
            _num(c.kl_quantiles["max"]),
            _num(c.rkl.mean),
            f"{_pct(c.top1.mean)} ± {_pct(c.top1.se)}",
            f"{_pct(c.dp_rms.rms)} ± {_pct(c.dp_rms.se)}",
        )
    return t


def _detail_table(comps: list[Comparison]) -> Table:
    """llama.cpp's KL-divergence and token-probability statistics, one column per model."""
    t = Table(title="KL divergence and token probability statistics", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("statistic", style="bold", no_wrap=True)
    for c in comps:
        t.add_column(c.model, justify="right", no_wrap=True, overflow="fold")
    rows: list[tuple[str, list[str]]] = [
        ("Mean ln(PPL(Q)/PPL(base))", [_pm(c.log_ratio.mean, c.log_ratio.se, 6) for c in comps]),
        ("Mean PPL(Q)/PPL(base)", [_pm(c.ppl_ratio, c.ppl_ratio_se, 6) for c in comps]),
        ("Cor(NLL(Q), NLL(base))", [_pct(c.nll_correlation, 2) for c in comps]),
        ("Mean KLD", [_pm(c.kl.mean, c.kl.se, 6) for c in comps]),
    ]
    for key, _ in KLD_QUANTILES:
        rows.append((f"{_qlabel(key)} KLD", [_num(c.kl_quantiles[key], 6) for c in comps]))
    rows.append(("Mean reverse KLD KL(Q‖base)", [_pm(c.rkl.mean, c.rkl.se, 6) for c in comps]))
    for key in ("p99", "median", "max"):
        rows.append((f"{_qlabel(key)} reverse KLD", [_num(c.rkl_quantiles[key], 6) for c in comps]))
    rows.append(("Mean Δp", [f"{_pct(c.dp.mean)} ± {_pct(c.dp.se)}" for c in comps]))
    for key, _ in DP_QUANTILES:
        rows.append((f"{_qlabel(key)} Δp", [_pct(c.dp_quantiles[key]) for c in comps]))
    rows.append(("RMS Δp", [f"{_pct(c.dp_rms.rms)} ± {_pct(c.dp_rms.se)}" for c in comps]))
    rows.append(("Same top p", [f"{_pct(c.top1.mean)} ± {_pct(c.top1.se)}" for c in comps]))
    for label, cells in rows:
        t.add_row(label, *cells)
    return t


def _qlabel(key: str) -> str:
    return {"max": "Maximum", "min": "Minimum", "median": "Median"}.get(key, key[1:] + "%")
