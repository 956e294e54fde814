"""``cortiq ppl``: perplexity of one or more models on one text, and how the others drift
from the first (or from a reference saved with ``--save-ref``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Callable

import typer
from rich import box
from rich.table import Table

from cortiq_cli import cluster_options as copt
from cortiq_cli import text_options as opt
from cortiq_cli.common import KvCache, console, err_console, handle_errors, human_bytes, print_json, print_table
from cortiq_cli.eval_run import interrupted, load_engines, model_label, scoring_progress, whole_windows
from cortiq_cli.help import cortiq_version
from evals.perplexity import (
    DP_QUANTILES,
    KLD_QUANTILES,
    Comparison,
    PerplexityAccumulator,
    PerplexityReport,
    PerplexityResult,
    build_reports,
    window_partial,
)
from evals.reference import (
    DEFAULT_SAMPLES,
    DEFAULT_TOP_K,
    ReferenceIdentity,
    ReferenceRecorder,
    SavedReference,
    form_name,
    text_sha256,
    tokenizer_fingerprint,
)
from evals.scoring import count_scored, iter_scored, scored_text_bytes
from evals.text_source import LoadedText, load_text
from evals.tokens import chunk_bos, tokenize_for
from evals.windows import DEFAULT_CTX, Window, WindowSettings, plan_windows, resolve_settings
from formats.errors import CortiqError

REF_PANEL = "Reference"


@handle_errors
def ppl(
    models: Annotated[
        list[Path],
        typer.Argument(
            help="CMF model files; the first is the reference for comparisons (unless --ref).", show_default=False
        ),
    ],
    text: opt.TextFile = None,
    dataset: opt.Dataset = None,
    config: opt.Config = None,
    split: opt.Split = None,
    column: opt.Column = None,
    data_files: opt.DataFiles = None,
    max_tokens: opt.MaxTokens = None,
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
    stride: opt.Stride = None,
    mode: opt.Mode = None,
    chunks: opt.Chunks = None,
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
    batch: opt.BlockRows = 512,
    kv_cache: KvCache = "f32",
    threads: opt.Threads = None,
    json_out: opt.Json = False,
    cluster: copt.Cluster = None,
    cluster_threads: copt.ClusterThreads = None,
    resume: copt.Resume = False,
) -> None:
    """Perplexity, NLL with its standard error, bits per byte; with several models (or --ref), llama.cpp's KL-divergence statistics against the reference."""
    if ref is not None and save_ref is not None:
        raise CortiqError("--ref and --save-ref cannot be combined (save the reference in its own run)")
    if save_ref is not None and any(save_ref.resolve() == m.resolve() for m in models):
        raise CortiqError(f"--save-ref {save_ref} is one of the models; give a new file name such as ref.cref")
    where = copt.check(cluster, resume)
    if where is not None and save_ref is not None:
        raise CortiqError("--save-ref runs in one process: save the reference without --cluster")
    saved = SavedReference(ref) if ref is not None else None
    settings = resolve_settings(mode, ctx, stride, max_tokens, chunks, saved.settings if saved else None)
    source = load_text(opt.text_spec(text, dataset, config, split, column, data_files))
    engines = load_engines(models, threads, settings.ctx, kv_cache)
    names = [model_label(p, e) for p, e in zip(models, engines)]
    tokens = tokenize_for(engines, names, source.text)
    windows = plan_windows(settings, len(tokens), chunk_bos(engines[0].tokenizer))
    if not windows:
        raise CortiqError("nothing to score: the window plan is empty")
    ident = ReferenceIdentity(
        tokenizer_fingerprint(engines[0].tokenizer, engines[0].vocab_size),
        text_sha256(source.text),
        int(engines[0].vocab_size),
    )
    if saved is not None:
        saved.check(ident, tokens, windows)
        names = [f"{saved.name} (saved)"] + names
    recorder = None
    if save_ref is not None:
        meta = reference_meta(models[0], names[0], engines[0], ident, source, settings, windows)
        recorder = ReferenceRecorder(
            save_ref,
            tokens=tokens,
            windows=windows,
            vocab_size=int(engines[0].vocab_size),
            top_k=ref_top_k,
            samples=ref_samples,
            meta=meta,
        )
    total = count_scored(windows)
    creport = None
    try:
        if where is not None:
            result, done, creport = copt.score_ppl(
                where,
                cluster_threads or engines[0].threads,
                resume,
                not json_out,
                models,
                settings.ctx,
                kv_cache,
                batch,
                names,
                tokens,
                windows,
                engines[0].tokenizer,
                saved=saved,
            )
        elif json_out:
            result, done = score_partial(
                engines, names, tokens, windows, engines[0].tokenizer, batch, saved=saved, recorder=recorder
            )
        else:
            with scoring_progress("scoring", "ppl") as bar:
                task = bar.add_task("ppl", total=total, value="-")

                def progress(done: int, _total: int, running: float) -> None:
                    bar.update(task, completed=done, value=f"{running:.4f}")

                result, done = score_partial(
                    engines,
                    names,
                    tokens,
                    windows,
                    engines[0].tokenizer,
                    batch,
                    progress,
                    saved=saved,
                    recorder=recorder,
                )
        if recorder is not None:
            if done < len(windows):
                recorder.abort()
            else:
                recorder.commit()
    except BaseException:
        if recorder is not None:
            recorder.abort()
        raise

    info = {
        **settings.to_json(),
        "windows": len(windows),
        "chunk_bos": windows[0].bos if settings.mode == "chunks" else None,
        "text_tokens": int(len(tokens)),
        "reference": (
            {"path": str(ref), "form": saved.form, "model": saved.name}
            if saved
            else {"path": str(models[0]), "form": "full", "model": names[0]}
        ),
        **(
            {
                "saved_ref": {
                    "path": str(save_ref),
                    "form": form_name(recorder.top_k, recorder.samples),
                    "bytes": save_ref.stat().st_size,
                }
            }
            if recorder is not None and done == len(windows)
            else {}
        ),
        # only after a Ctrl-C: the figures cover the first windows_done windows
        **({"partial": True, "windows_done": done} if done < len(windows) else {}),
        **({"cluster": creport.to_json()} if creport is not None else {}),
    }
    paths = ([ref] if saved else []) + list(models)
    if json_out:
        print_json(to_json(source, info, result, paths))
    else:
        render(source, info, result)
        if creport is not None:
            copt.render_report(creport)
    if done < len(windows):
        if recorder is not None:
            err_console.print(f"[yellow]{save_ref} was not written (the pass did not finish)[/]", highlight=False)
        if creport is not None:
            copt.note_interrupted()
        interrupted(done, len(windows))


def reference_meta(
    path: Path,
    label: str,
    engine: Any,
    ident: ReferenceIdentity,
    source: LoadedText,
    settings: WindowSettings,
    windows: list[Window],
) -> dict[str, Any]:
    """The saved reference's identity: checked by --ref, shown by inspect."""
    return {
        "model": {"path": str(path), "label": label, "arch": getattr(getattr(engine, "arch", None), "arch", None)},
        "tokenizer": {
            "fingerprint": ident.tokenizer,
            "vocab_size": ident.vocab_size,
            "bos_id": getattr(engine.tokenizer, "bos_id", None),
            "add_bos": bool(getattr(engine.tokenizer, "add_bos", False)),
        },
        "text": {"sha256": ident.text_sha256, "source": source.source, "bytes": source.n_bytes},
        "settings": settings.to_json(),
        "tool": f"cortiq ppl {cortiq_version()}",
    }


def score_partial(
    engines: list[Any],
    names: list[str],
    tokens: Any,
    windows: list[Window],
    decoder: Any,
    chunk: int,
    progress: Callable[[int, int, float], None] | None = None,
    *,
    saved: SavedReference | None = None,
    recorder: ReferenceRecorder | None = None,
) -> tuple[PerplexityResult, int]:
    """Score every model in lockstep; on Ctrl-C, the figures over the windows done so far
    (and how many); with none done the interrupt goes on up."""
    acc = PerplexityAccumulator(len(engines), saved_ref=saved is not None)
    total, done = count_scored(windows), 0
    try:
        for group in whole_windows(iter_scored(engines, tokens, windows, chunk=chunk), windows):
            refs = [saved.next_rows(len(b.targets)) for b in group] if saved is not None else None
            if recorder is not None:
                for block in group:
                    recorder.add(block.logits[0], block.targets)
            acc.add_partial(window_partial(group[0].window, group, len(engines), refs))
            done = group[0].window + 1
            if progress:
                progress(acc.count, total, acc.running_ppl)
    except KeyboardInterrupt:
        if not acc.count:
            raise
    form = saved.form if saved is not None else "full"
    reports, comps = build_reports(acc, names, scored_text_bytes(decoder, tokens, windows[:done]), form)
    return PerplexityResult(reports, comps), done


def to_json(
    source: LoadedText, settings: dict[str, Any], result: PerplexityResult, paths: list[Path]
) -> dict[str, Any]:
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
