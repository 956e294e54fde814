"""``cortiq imatrix``: per-input-column activation energy of every weight over real text."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cortiq_cli import cluster_options as copt
from cortiq_cli import text_options as opt
from cortiq_cli.options import option_groups
from cortiq_cli.common import console, handle_errors, print_json
from cortiq_cli.eval_run import cluster_bar, cluster_run, counting_bar
from evals.runs import ClusterInterrupted, ImatrixRequest, run_imatrix
from evals.windows import DEFAULT_CTX
from formats.errors import CortiqError
from formats.imatrix import write_imatrix


@handle_errors
@option_groups
def imatrix(
    model: Path = typer.Argument(
        ..., help="CMF model to run (f32 or a high-precision type gives the truest activations)."
    ),
    out: Annotated[
        Optional[Path],
        typer.Option("--out", "-o", help="Output file (safetensors; default MODEL.imatrix.safetensors)."),
    ] = None,
    text_opts: opt.BoundedTextArgs = opt.BoundedTextArgs(),
    ctx: opt.Ctx = DEFAULT_CTX,
    window_opts: opt.WindowArgs = opt.WindowArgs(),
    threads: opt.Threads = None,
    force: bool = typer.Option(False, "--force", help="Overwrite OUT if it exists."),
    json_out: opt.Json = False,
    cluster_opts: opt.ClusterArgs = opt.ClusterArgs(),
) -> None:
    """Collect an importance matrix for ``cortiq convert --imatrix``: for every weight, the
    mean squared input activation of each column over every token the windows feed (the
    windows ppl scores: by default llama.cpp's chunks, as llama-imatrix)."""
    request = ImatrixRequest(
        model,
        text_opts.spec(),
        window_opts.options(ctx, text_opts.max_tokens),
        threads,
    )
    where = cluster_opts.where()
    out = out or model.with_name(model.stem + ".imatrix.safetensors")
    if out.exists() and not force:
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    try:
        if where is not None:
            with cluster_bar() as bar:
                run = run_imatrix(request, cluster=cluster_run(where, cluster_opts, None if json_out else bar))
        else:
            with counting_bar("collecting", "tokens") as bar:
                run = run_imatrix(request, None if json_out else bar)
    except ClusterInterrupted:  # never write an imatrix of part of the text
        copt.note_interrupted()
        raise
    means, tokens, creport, source = run.means, run.tokens, run.cluster, run.source
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
