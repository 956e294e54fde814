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
from cortiq_cli.eval_run import progress_bar, scoring_bars
from cortiq_cli.mtp_options import MTP_PANEL, MtpDepth, MtpPath, MtpThreshold, MtpVocab
from evals.cluster import probe_mtp as probe_on_cluster
from evals.tokens import encode_sharded
from formats.errors import CortiqError


def _choices(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    if value == "all":
        return list(allowed)
    if value not in allowed:
        raise CortiqError(f"unknown {flag} {value!r}; choose all or one of {', '.join(allowed)}")
    return [value]


@handle_errors
@option_groups
def mtp_probe(
    model: Annotated[Path, typer.Argument(help="CMF model file.", show_default=False)],
    text_opts: opt.TextArgs = opt.TextArgs(),
    max_tokens: Annotated[
        int,
        typer.Option(
            "--text-tokens",
            "--max-tokens",
            min=3,
            help="Probe the first N tokens of the text.",
            rich_help_panel=opt.TEXT_PANEL,
        ),
    ] = 512,
    mtp: MtpPath = None,
    depth: MtpDepth = None,
    chain: Annotated[
        str,
        typer.Option(
            "--mtp-chain",
            metavar="all|independent|recursive",
            help="all, independent (layer k drafts depth k+1) or recursive (layer 0 on its own output).",
            rich_help_panel=MTP_PANEL,
        ),
    ] = "all",
    hidden: Annotated[
        str,
        typer.Option(
            "--mtp-hidden",
            metavar="all|pre|post",
            help="all, pre or post: the backbone hidden before or after its final norm.",
            rich_help_panel=MTP_PANEL,
        ),
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
    from cortiq_engine import Engine
    from cortiq_engine.mtp import CHAINS, HIDDENS
    from cortiq_engine.lookup import DEFAULT_LOOKUP, DEFAULT_NGRAM
    from evals.mtp_probe import (
        best_setting,
        default_variants,
        lookup_rounds,
        probe,
        threshold_table,
        verify_costs,
        with_lookup_setting,
    )

    where = cluster_opts.where()
    loaded = text_opts.load()
    eng = Engine.load(model, threads=threads, mtp=mtp if mtp is not None else True)
    stack = eng.drafts
    if stack is None:
        raise CortiqError(
            f"{model}: no MTP draft layers (none inline, no sidecar beside it); train them with "
            f"`cortiq mtp-train {model}` (it writes the sidecar beside the model), or give --mtp PATH"
        )
    ids = encode_sharded(eng.tokenizer, loaded.pieces(), limit=max_tokens).tolist()  # the text's first tokens
    k = depth or stack.num_layers
    chains, hiddens = _choices(chain, CHAINS, "--mtp-chain"), _choices(hidden, HIDDENS, "--mtp-hidden")
    variants = [v for v in default_variants(stack.num_layers, k) if v.chain in chains and v.hidden in hiddens]
    if not variants:
        raise CortiqError(
            f"--mtp-chain independent needs a draft layer per depth: depth {k}, {stack.num_layers} layers"
        )

    steps = max(len(ids) - k - 1, 0) * len(variants)
    if choose_threshold and threshold:
        raise CortiqError("--choose-threshold replays thresholds itself; leave --mtp-threshold out")
    if save and not choose_threshold:
        raise CortiqError("--save records what --choose-threshold measures: give both")
    if save and stack.source == "inline":
        raise CortiqError("--save writes to an MTP sidecar; these draft layers are inline in the model file")
    if save and vocab is not None:
        raise CortiqError(
            "--save measures the sidecar's own draft vocabulary (the one generate uses): leave --mtp-vocab out"
        )
    if save and not any(v.chain == "independent" and v.hidden == "pre" for v in variants):
        raise CortiqError(
            "--save measures the drafts generate runs (independent layers, pre-norm hidden): "
            "leave --mtp-chain and --mtp-hidden at all, or set them to independent and pre"
        )
    head = eng.draft_head(vocab)  # a string: read as --mtp-vocab is (draft_vocab.parse_vocab)
    traces = [] if choose_threshold else None
    kw = dict(head=head, threshold=threshold or 0.0, traces=traces)
    creport = None
    if where is not None:
        # The workers load the same draft layers: inline, or this sidecar (checked to be the driver's file).
        sidecar = None if stack.source == "inline" else Path(stack.source)
        with scoring_bars(json_out, on_cluster=True, field="") as (_, shown):
            results, got, complete, creport = probe_on_cluster(
                where,
                cluster_opts.cluster_threads or eng.threads,
                model,
                sidecar,
                ids,
                k,
                variants,
                vocab=vocab,
                threshold=threshold or 0.0,
                trace=traces is not None,
                resume=cluster_opts.resume,
                progress=shown,
            )
        if not complete:
            copt.note_interrupted()  # no figures of part of the rounds
            raise KeyboardInterrupt
        if traces is not None:
            traces.extend(got)
    elif json_out:
        results = probe(eng.model, stack, ids, k, variants, **kw)
    else:
        with progress_bar("probing", eta=False) as bar:
            task = bar.add_task("probe", total=steps)
            results = probe(eng.model, stack, ids, k, variants, progress=lambda n: bar.advance(task, n), **kw)

    doc = {
        "model": str(model),
        "mtp": stack.source,
        "style": stack.style,
        "draft_layers": stack.num_layers,
        "depth": k,
        "text": loaded.source,
        "tokens": len(ids),
        "draft_vocab": head.label,
        "threshold": threshold or 0.0,
        "variants": [{"chain": v.chain, "hidden": v.hidden, **counts.to_json()} for v, counts in results],
        **({"cluster": creport.to_json()} if creport is not None else {}),
    }
    if traces is not None:
        verify_ms = verify_costs(eng.model, max(k, DEFAULT_LOOKUP) + 1)
        doc["verify_ms_by_rows"] = verify_ms
        for entry, (v, counts), trace in zip(doc["variants"], results, traces):
            draft_ms = 1e3 * counts.draft_seconds / max(counts.drafting_rounds, 1) / k  # per computed draft
            entry["thresholds"] = [r.to_json() for r in threshold_table(trace, draft_ms, verify_ms)]
            if save and (v.chain, v.hidden) == ("independent", "pre"):
                d, row = best_setting(trace, draft_ms, verify_ms)
                doc["saved"] = {
                    "depth": d,
                    "threshold": row.threshold,
                    "modelled_speedup": round(row.speedup, 4),
                    "tokens_per_step": round(row.tokens_per_step, 4),
                    "text": loaded.source,
                    "tokens": len(ids),
                    "draft_vocab": head.label,
                    "verify_ms_by_rows": verify_ms,
                }
                # ... and the setting when n-gram lookup drafts first (generate's default):
                # the probe's rounds are every t, the text their truth.
                looked = lookup_rounds(ids, range(trace.probs.shape[0]), DEFAULT_LOOKUP, DEFAULT_NGRAM)
                keys = [(0, t) for t in range(trace.probs.shape[0])]
                doc["saved"]["with_lookup"] = with_lookup_setting(
                    trace, *looked, keys, draft_ms, verify_ms, DEFAULT_LOOKUP, DEFAULT_NGRAM
                )
        if save:
            from formats.sidecar import write_defaults

            write_defaults(stack.source, doc["saved"])  # staged and renamed over: the open map stays valid
    if json_out:
        print_json(doc)
        return
    # One column per variant, side by side; one row per measure.
    table = Table(
        title=f"MTP teacher-forced acceptance ({len(ids)} tokens of {loaded.source}; {stack.num_layers} draft layer(s): "
        f"{stack.source}; draft vocab {head.label}; threshold {threshold or 0:g})"
    )
    table.add_column("chain/hidden", style="bold")
    counted = [c for _, c in results]
    for v, _ in results:
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
    if creport is not None:
        copt.render_report(creport)
    if traces is not None:
        t = Table(
            title=f"adaptive depth: modelled ms per token by --mtp-threshold (verify of 1..{k + 1} rows: "
            + ", ".join(f"{m:.1f}" for m in doc["verify_ms_by_rows"])
            + " ms; plain = 1 row)"
        )
        t.add_column("threshold", justify="right")
        for v, _ in results:
            t.add_column(f"{v.chain}/{v.hidden}\ntok/step · drafts · ms/tok · speedup", justify="right")
        tables = [e["thresholds"] for e in doc["variants"]]
        for i, row in enumerate(tables[0]):
            t.add_row(
                f"{row['threshold']:g}",
                *(
                    f"{tb[i]['tokens_per_step']:.2f} · {tb[i]['mean_depth']:.2f} · "
                    f"{tb[i]['ms_per_token']:.2f} · {tb[i]['speedup']:.2f}x"
                    for tb in tables
                ),
            )
        print_table(console, t)
    if "saved" in doc:
        s = doc["saved"]
        console.print(
            f"saved in {stack.source}: generate now drafts depth {s['depth']} at threshold {s['threshold']:g} "
            f"by default (modelled {s['modelled_speedup']:.2f}x plain decoding)"
        )
        if s.get("with_lookup"):
            from cortiq_cli.mtp_options import with_lookup_line

            console.print(with_lookup_line(s), highlight=False)
