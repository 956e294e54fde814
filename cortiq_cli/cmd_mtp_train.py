"""``cortiq mtp-train``: train MTP draft layers for a frozen backbone and write them as its sidecar."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from cortiq_cli import text_options as opt
from cortiq_cli.options import option_groups
from cortiq_cli.common import console, handle_errors, print_json, print_table
from cortiq_cli.eval_run import progress_bar
from cortiq_cli.mtp_options import Backbone, hidden_option

TRAIN_PANEL = "Training"


def train_option(*flags: str, **kwargs: Any) -> Any:
    """A ``typer.Option`` of the Training panel."""
    return typer.Option(*flags, rich_help_panel=TRAIN_PANEL, **kwargs)


@handle_errors
@option_groups
def mtp_train(
    model: Backbone,
    text_opts: opt.TextArgs = opt.TextArgs(),
    max_tokens: Annotated[
        Optional[int], opt.text_tokens("Use at most this many tokens of the text (training + held out).")
    ] = None,
    holdout: Annotated[
        float,
        typer.Option(
            "--holdout",
            help="Fraction of the windows (the last ones) held out for the acceptance report.",
            rich_help_panel=opt.TEXT_PANEL,
        ),
    ] = 0.1,
    layers: Annotated[
        int,
        train_option("--layers", "-k", help="Draft layers K: depth k predicts k+1 tokens past the next."),
    ] = 1,
    steps: Annotated[
        int,
        train_option("--steps", help="Optimizer steps (total, a resumed run included)."),
    ] = 200,
    seq: Annotated[
        int,
        train_option("--seq", help="Tokens per window (backbone context and draft sequence)."),
    ] = 256,
    batch: Annotated[int, train_option("--batch", help="Windows per step.")] = 2,
    lr: Annotated[
        float,
        train_option("--lr", help="Peak learning rate (AdamW, warm-up then cosine to lr/10)."),
    ] = 5e-4,
    warmup: Annotated[int, train_option("--warmup", help="Warm-up steps.")] = 10,
    intermediate: Annotated[
        Optional[int],
        train_option("--intermediate", help="Draft MLP width (default: the backbone's)."),
    ] = None,
    init_layer: Annotated[
        int,
        train_option("--init-layer", help="Backbone layer the draft blocks start from (negative counts from the end)."),
    ] = -1,
    mtp_hidden: Annotated[
        str, hidden_option("pre|post", "Backbone hidden the drafts read: pre or post its final norm.", TRAIN_PANEL)
    ] = "pre",
    topk: Annotated[int, train_option("--topk", help="Teacher probabilities kept per position.")] = 32,
    vocab: Annotated[
        str,
        train_option(
            "--vocab",
            metavar="active|full",
            help="Draft softmax during training: active (tokens the teacher uses, + random negatives) or full.",
        ),
    ] = "active",
    backbone: Annotated[
        str,
        train_option(
            "--backbone",
            metavar="engine|torch",
            help="Who runs the frozen backbone to collect its hidden rows: engine (the decode path's exact numbers) or torch (faster on CPU, llama-style blocks only; checked against the engine first).",
        ),
    ] = "engine",
    ttt: Annotated[
        Optional[bool],
        train_option(
            "--ttt/--teacher-forcing",
            help="Training-time test: depth k reads the drafts of depths < k where inference does, or the true tokens (default: TTT for --chain recursive, teacher forcing for independent).",
            show_default=False,
        ),
    ] = None,
    chain: Annotated[
        str,
        train_option(
            "--chain",
            metavar="independent|recursive",
            help="How the drafts chain: independent (K layers) or recursive (one layer re-fed, --layers 1).",
        ),
    ] = "independent",
    depth: Annotated[int, train_option("--depth", help="Depths trained with --chain recursive (0: 3).")] = 0,
    features: Annotated[
        Optional[Path],
        train_option(
            "--features",
            help="Keep the collected backbone rows in this folder (memory-mapped, resumed after a kill, reused by runs on the same text; default: the run's work folder in the cache, removed when the run succeeds).",
        ),
    ] = None,
    feature_dtype: Annotated[
        str,
        train_option("--feature-dtype", metavar="f16|f32", help="Stored hidden rows: f16 (half the disk) or f32."),
    ] = "f16",
    self_distill: Annotated[
        int,
        train_option(
            "--self-distill",
            help="Train on the backbone's own text: each window keeps this many real tokens and the backbone continues it (0: real text only).",
        ),
    ] = 0,
    self_temperature: Annotated[
        float,
        train_option(
            "--self-temperature", help="With --self-distill: sample the continuations at this temperature (0: greedy)."
        ),
    ] = 0.0,
    chat: Annotated[
        bool,
        train_option(
            "--chat",
            help="Train on chat turns: each window asks about a passage of the text through the model's chat template and the backbone answers (greedy, or at --self-temperature); with --self-distill N, chat turns alternate with plain windows.",
        ),
    ] = False,
    seed: Annotated[int, train_option("--seed", help="Seed of the window choice and negatives.")] = 0,
    checkpoint_every: Annotated[
        int,
        train_option(
            "--checkpoint-every",
            help="Save a checkpoint (safetensors, no pickle; in the run's work folder under $XDG_CACHE_HOME/cortiq/mtp-train) every N steps; 0 = never.",
        ),
    ] = 50,
    resume: Annotated[
        bool,
        train_option(
            "--resume",
            help="Continue from the checkpoint of a stopped (or --keep-checkpoint) run for the same output, checked against this run first.",
        ),
    ] = False,
    keep_checkpoint: Annotated[
        bool,
        train_option(
            "--keep-checkpoint",
            help="Keep the checkpoint and collected rows after a successful run (for a later --resume with more --steps); by default only the sidecar remains.",
        ),
    ] = False,
    draft_vocab: Annotated[
        Optional[int],
        train_option(
            "--draft-vocab",
            min=1,
            help="Also store a draft vocabulary of N ids chosen from the training text (the drafts then score only those; `cortiq mtp-vocab` changes it later).",
        ),
    ] = None,
    defaults: Annotated[
        bool,
        train_option(
            "--defaults/--no-defaults",
            help="After training, time this machine's drafts and verifies on the live rounds of the held-out windows (the backbone's own text: --self-distill or --chat) and store the fastest depth and --mtp-threshold in the sidecar as generate's defaults.",
        ),
    ] = True,
    out: Annotated[
        Optional[Path], typer.Option("--out", "-o", help="Sidecar to write (default: MODEL.mtp.cmf beside MODEL.cmf).")
    ] = None,
    quant: Annotated[
        Optional[str],
        typer.Option("--quant", metavar="DTYPE", help="Sidecar matrices' dtype (default: the backbone's)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing sidecar.")] = False,
    threads: opt.Threads = None,
    json_out: opt.Json = False,
) -> None:
    """Train K MTP draft layers on a frozen backbone by distillation, write them as its sidecar, report held-out acceptance."""
    from cortiq_train.config import TrainConfig
    from cortiq_train.run import Callbacks, train_mtp
    from cortiq_train.trainer import require_torch

    require_torch()  # the optional [train] extra: one line before any text is read

    cfg = TrainConfig(
        layers=layers,
        steps=steps,
        seq=seq,
        batch=batch,
        lr=lr,
        warmup=warmup,
        topk=topk,
        intermediate=intermediate,
        init_layer=init_layer,
        hidden=mtp_hidden,
        vocab=vocab,
        holdout=holdout,
        max_tokens=max_tokens,
        seed=seed,
        checkpoint_every=checkpoint_every,
        ttt=ttt,
        chain=chain,
        depth=depth,
        feature_dtype=feature_dtype,
        self_distill=self_distill,
        self_temperature=self_temperature,
        chat=chat,
    )
    cfg.check(num_layers=1 << 30)  # the one-line messages before any file is read; layers are checked again
    source = text_opts.load()

    def train(callbacks: Any = None) -> Any:
        return train_mtp(
            model,
            source.text,
            source.source,
            cfg,
            out=out,
            quant=quant,
            resume=resume,
            keep_checkpoint=keep_checkpoint,
            force=force,
            threads=threads,
            backend=backbone,
            callbacks=callbacks,
            features=features,
            draft_vocab=draft_vocab,
        )

    if json_out:
        result = train()
        if defaults:
            result.extra["defaults"] = _defaults_json(_measure_defaults(model, result, threads))
        print_json(result.to_json())
        return
    with progress_bar("{task.description}", "{task.fields[info]}") as bar:
        tasks: dict[str, Any] = {}

        def collect(done: int, total: int) -> None:
            if "collect" not in tasks:
                tasks["collect"] = bar.add_task("backbone", total=total, info="tokens")
            bar.update(tasks["collect"], completed=done)

        def generate(done: int, total: int) -> None:
            if "generate" not in tasks:
                tasks["generate"] = bar.add_task("backbone text", total=total, info="windows")
            bar.update(tasks["generate"], completed=done)

        def step(done: int, total: int, loss: float, agree: list[float]) -> None:
            if "train" not in tasks:
                tasks["train"] = bar.add_task("training", total=total, completed=done - 1, info="")
            acc = " ".join(f"d{i + 1} {a:.0%}" for i, a in enumerate(agree))
            bar.update(tasks["train"], completed=done, info=f"loss [cyan]{loss:.4f}[/]  top-1 {acc}")

        result = train(Callbacks(collect=collect, step=step, generate=generate))
        found = None
        if defaults:
            task = bar.add_task("defaults (live rounds)", total=None, info="")
            found = _measure_defaults(model, result, threads, lambda n: bar.advance(task, n))
    render(result, found)


def _measure_defaults(model: Path, result, threads: int | None, progress=None):
    """generate's default depth and threshold, measured on the held-out windows (None:
    nothing to measure them on, or draft layers generate does not run as trained)."""
    from evals.mtp_probe import LiveDefaults, save_live_defaults

    cfg = result.config
    if result.held_tokens is None or not len(result.held_tokens):
        return LiveDefaults(None, 0, None, "no held-out windows")
    if cfg.chain != "independent" or cfg.hidden != "pre":
        return LiveDefaults(
            None, 0, None, "generate's defaults are measured for independent layers on the pre-norm hidden"
        )
    return save_live_defaults(
        model,
        result.sidecar,
        result.held_tokens,
        result.held_greedy,
        f"{result.source} (held out)",
        threads=threads,
        progress=progress,
    )


def _defaults_json(found) -> dict[str, Any]:
    return {
        "saved": found.record,
        "live_rounds": found.rounds,
        "reason": found.reason or None,
        "acceptance": found.counts.to_json() if found.counts is not None else None,
    }


def render(r, found=None) -> None:
    first = r.losses[r.start_step] if len(r.losses) > r.start_step else None
    last = r.losses[-1] if r.losses else None
    resumed = f", resumed at step {r.start_step}" if r.start_step else ""
    loss = f"loss {first:.4f} -> {last:.4f}" if first is not None and last is not None else "no steps run"
    console.print(
        f"[bold]{r.config.layers}[/] draft layer(s), {r.steps} steps{resumed}: {loss} "
        f"({r.train_seconds:.1f} s training, {r.collect_seconds:.1f} s backbone); "
        f"{r.tokens} tokens, {r.train_windows} training / {r.held_windows} held-out windows of {r.config.seq}; "
        f"text: {r.source}",
        highlight=False,
    )
    acc = r.held_engine
    if acc is not None:
        t = Table(title="held-out acceptance (teacher-forced, vs the backbone's greedy token)")
        t.add_column("depth", justify="right")
        t.add_column("alone", justify="right")
        t.add_column("chained", justify="right")
        t.add_column("rows", justify="right")
        for d, (a, c, n) in enumerate(zip(acc.alone, acc.chained, acc.checked)):
            t.add_row(f"d{d + 1}", f"{a:.1%}", f"{c:.1%}", str(n))
        print_table(console, t)
        console.print(f"expected tokens per round: [bold]{acc.tokens_per_round:.3f}[/]", highlight=False)
    if found is not None and found.record is not None:
        d = found.record
        console.print(
            f"generate's defaults (stored in the sidecar): depth [bold]{d['depth']}[/], --mtp-threshold "
            f"[bold]{d['threshold']:g}[/]: modelled {d['modelled_speedup']:.2f}x plain decoding, "
            f"{d['tokens_per_step']:.2f} tokens a step over {found.rounds} live held-out rounds",
            highlight=False,
        )
        if d.get("with_lookup"):
            from cortiq_cli.mtp_options import with_lookup_line

            console.print(with_lookup_line(d), highlight=False)
        if d["modelled_speedup"] < 1.0:
            console.print(
                "[yellow]speculation is modelled slower than plain decoding on this machine: "
                "generate with --no-mtp, or train longer[/]",
                highlight=False,
            )
    elif found is not None:
        console.print(f"no measured defaults: {found.reason}", highlight=False)
    console.print(
        f"wrote [bold]{r.sidecar}[/]" + (f"  (checkpoint {r.checkpoint})" if r.checkpoint else ""), highlight=False
    )
