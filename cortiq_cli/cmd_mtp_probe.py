"""``cortiq mtp-probe``: teacher-forced acceptance of a model's MTP draft layers on a text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from cortiq_cli import cluster_options as copt
from cortiq_cli import text_options as opt
from cortiq_cli.options import option_groups
from cortiq_cli.common import console, handle_errors, print_json, print_table
from cortiq_cli.eval_run import cluster_bar, cluster_run, counting_bar
from cortiq_cli.mtp_options import (
    MTP_PANEL,
    MtpDepth,
    MtpPath,
    MtpThreshold,
    MtpVocab,
    chain_option,
    hidden_option,
    with_lookup_line,
)
from evals.mtp_probe import ProbeRequest, ProbeRun, run_probe
from evals.runs import ClusterInterrupted


@handle_errors
@option_groups
def mtp_probe(
    model: Annotated[Path, typer.Argument(help="CMF model file.", show_default=False)],
    text_opts: opt.TextArgs = opt.TextArgs(),
    max_tokens: Annotated[int, opt.text_tokens("Probe the first N tokens of the text.", min=3)] = 512,
    mtp: MtpPath = None,
    depth: MtpDepth = None,
    chain: Annotated[
        str,
        chain_option(
            "all|independent|recursive",
            "all, independent (layer k drafts depth k+1) or recursive (layer 0 on its own output).",
        ),
    ] = "all",
    hidden: Annotated[
        str, hidden_option("all|pre|post", "all, pre or post: the backbone hidden before or after its final norm.")
    ] = "all",
    vocab: MtpVocab = None,
    threshold: MtpThreshold = None,
    choose_threshold: Annotated[
        bool,
        typer.Option(
            "--choose-threshold",
            help="Also time a verify of 1..depth+1 rows and replay the rounds under candidate --mtp-threshold values: modelled ms per token for each (pick the least).",
            rich_help_panel=MTP_PANEL,
        ),
    ] = False,
    save: Annotated[
        bool,
        typer.Option(
            "--save",
            help="With --choose-threshold: record the fastest depth and threshold of the independent/pre drafts (what generate runs) in the sidecar, as the defaults generate then uses.",
            rich_help_panel=MTP_PANEL,
        ),
    ] = False,
    threads: opt.Threads = None,
    json_out: opt.Json = False,
    cluster_opts: opt.ClusterArgs = opt.ClusterArgs(),
) -> None:
    """What each draft depth would propose at every position of a text, given the true
    previous tokens, against the true next tokens (per depth alone and chained)."""
    where = cluster_opts.where()
    request = ProbeRequest(
        model,
        text_opts.spec(),
        max_tokens,
        mtp=mtp,
        depth=depth,
        chain=chain,
        hidden=hidden,
        vocab=vocab,
        threshold=threshold,
        choose_threshold=choose_threshold,
        save=save,
        threads=threads,
    )
    try:
        if where is not None:
            with cluster_bar() as bar:
                run = run_probe(request, cluster=cluster_run(where, cluster_opts, None if json_out else bar))
        else:
            with counting_bar("probing", eta=False) as bar:
                run = run_probe(request, None if json_out else bar)
    except ClusterInterrupted:  # no figures of part of the rounds
        copt.note_interrupted()
        raise
    if json_out:
        print_json(run.to_json())
        return
    render(run)


def render(run: ProbeRun) -> None:
    """One column per variant, side by side; one row per measure. Then the threshold
    table and the saved defaults when measured."""
    k, counted = run.depth, [c for _, c in run.results]
    table = Table(
        title=f"MTP teacher-forced acceptance ({run.tokens} tokens of {run.text}; {run.draft_layers} draft layer(s): "
        f"{run.mtp}; draft vocab {run.draft_vocab}; threshold {run.threshold:g})"
    )
    table.add_column("chain/hidden", style="bold")
    for v, _ in run.results:
        table.add_column(f"{v.chain}\n{v.hidden} norm", justify="right")
    for d in range(k):
        table.add_row(f"d{d + 1} alone", *(f"{c.alone[d]:.1%}" for c in counted))
    for d in range(k):
        table.add_row("&".join(f"d{i + 1}" for i in range(d + 1)), *(f"{c.chained[d]:.1%}" for c in counted))
    table.add_row("tokens/round", *(f"{c.tokens_per_round:.3f}" for c in counted), style="bold")
    table.add_row("draft ms/round", *(f"{1e3 * c.draft_seconds / max(c.rounds, 1):.2f}" for c in counted))
    table.add_row("drafts/round", *(f"{c.to_json()['mean_depth']:.2f}" for c in counted))
    table.add_row("positions", *(str(c.drafting_rounds) for c in counted), style="dim")
    print_table(console, table)
    if run.cluster is not None:
        copt.render_report(run.cluster)
    if run.thresholds is not None:
        t = Table(
            title=f"adaptive depth: modelled ms per token by --mtp-threshold (verify of 1..{k + 1} rows: "
            + ", ".join(f"{m:.1f}" for m in run.verify_ms or [])
            + " ms; plain = 1 row)"
        )
        t.add_column("threshold", justify="right")
        for v, _ in run.results:
            t.add_column(f"{v.chain}/{v.hidden}\ntok/step · drafts · ms/tok · speedup", justify="right")
        for i, row in enumerate(run.thresholds[0]):
            t.add_row(
                f"{row.threshold:g}",
                *(
                    f"{tb[i].tokens_per_step:.2f} · {tb[i].mean_depth:.2f} · {tb[i].ms_per_token:.2f} · {tb[i].speedup:.2f}x"
                    for tb in run.thresholds
                ),
            )
        print_table(console, t)
    if run.saved is not None:
        s = run.saved
        console.print(
            f"saved in {run.mtp}: generate now drafts depth {s['depth']} at threshold {s['threshold']:g} "
            f"by default (modelled {s['modelled_speedup']:.2f}x plain decoding)"
        )
        if s.get("with_lookup"):
            console.print(with_lookup_line(s), highlight=False)
