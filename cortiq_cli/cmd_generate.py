"""``cortiq generate MODEL.cmf PROMPT``: stream a continuation to the terminal.

Greedy decoding is the default (``--temp 0``) so the same command gives the
same text every time; any temperature > 0 samples (seeded by ``--seed``). The text
streams to stdout as it is produced; the closing statistics line goes to stderr, so
``cortiq generate ... > out.txt`` keeps only the text. Ctrl-C ends the line, prints the
statistics so far and exits 130; a reader that closes the pipe (``| head``) ends it quietly. ``--json`` prints one JSON
object instead (text, per-token id/text/confidence, with ``--logprobs N`` the top-N
log-probabilities per step, timings, peak RSS, finish reason, and ``compile_seconds``: the
kernel compilation at load, which the prefill and decode figures never include).
On a machine that has not run this kind of model yet, load compiles the kernels for the
CPU first (one line on stderr says so; later runs load them from the on-disk caches).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from cortiq_cli import generation as gen
from cortiq_cli import mtp_options as mtp_opt
from cortiq_cli import options as opts
from cortiq_cli.common import EXIT_INTERRUPTED, KvCache, err_console, handle_errors, print_json, read_prompt
from cortiq_cli.moe_stats import moe_stats_json, print_moe_stats
from formats.errors import CortiqError


@handle_errors
@opts.option_groups
def generate(
    model: Annotated[
        Optional[str], typer.Argument(help="Model file (.cmf); or give -m/--model.", show_default=False)
    ] = None,
    prompt: Annotated[
        Optional[str],
        typer.Argument(
            help="Prompt text; '-' reads it from stdin (or give -p/--prompt or --prompt-file).", show_default=False
        ),
    ] = None,
    model_opt: opts.ModelOption = None,
    prompt_opt: opts.PromptOption = None,
    prompt_file: Annotated[
        Optional[Path], typer.Option("--prompt-file", "-f", help="Read the prompt from this file (UTF-8).")
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", min=1, help="Generate at most this many tokens.")
    ] = 256,
    sampling: opts.SamplingArgs = opts.SamplingArgs(),
    stop: Annotated[
        Optional[list[str]],
        typer.Option("--stop", help="Stop when this string appears (repeatable); it is not printed."),
    ] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template as a user message.")
    ] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message (implies --chat).")] = None,
    ctx: opts.Ctx = None,
    evict: Annotated[
        bool,
        opts.evict_option(
            "When the context is full, drop its oldest half and go on (positions keep increasing) instead of stopping."
        ),
    ] = False,
    kv_cache: KvCache = "f32",
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Do not stop at end-of-sequence tokens (benchmarks).")
    ] = False,
    threads: opts.Threads = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")] = False,
    logprobs: Annotated[
        int,
        gen.logprobs_option(
            "Each step's N most likely tokens with their log-probabilities (in --json; else listed after the text)."
        ),
    ] = 0,
    moe_stats: Annotated[
        bool,
        typer.Option(
            "--moe-stats", help="MoE models: show how often each expert of each layer was chosen (and in --json)."
        ),
    ] = False,
    spec: mtp_opt.SpecArgs = mtp_opt.SpecArgs(),
    mtp_compare: mtp_opt.MtpCompare = False,
) -> None:
    """Generate text from a prompt with a CMF model (greedy by default)."""
    model, prompt = opts.model_and_prompt(model, prompt, model_opt, prompt_opt)
    prompt = read_prompt(prompt, prompt_file)
    if not prompt:
        raise CortiqError("empty prompt: nothing to generate from")
    config = sampling.config()
    # The engine decodes speculatively (exact greedy) when it can, and says why not when it cannot.
    eng = spec.load_engine(model, threads=threads, ctx=ctx, quiet=json_out, kv_cache=kv_cache)
    speculative = spec.speculative()
    tok = eng.tokenizer
    if chat or system is not None:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = tok.encode(tok.apply_chat_template(messages), add_bos=False)
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise CortiqError("empty prompt: it encodes to no tokens")

    so_far: list[Any] = []  # every token event, for the partial result of a Ctrl-C
    clock = _Clock()

    def on_token(ev: Any) -> None:
        clock.tick()
        so_far.append(ev)

    clock.start()
    try:
        res = eng.generate(
            ids,
            config,
            max_tokens=max_tokens,
            stop=stop or [],
            on_text=None if json_out else gen.write_stdout,
            evict=evict,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            on_token=on_token,
            speculative=speculative,
        )
        if mtp_compare and "mtp" in res.extra:
            mtp_opt.compare_with_plain(
                eng, res, ids, config, max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos
            )
    except KeyboardInterrupt:
        if not json_out:
            gen.write_stdout("\n")  # the line the text was on ends, the figures so far follow
            _print_stats(
                len(ids),
                clock.prefill_tok_s(len(ids)),
                len(so_far),
                clock.decode_tok_s(len(so_far)),
                so_far,
                eng.calibration_temperature,
                "interrupted",
            )
            raise typer.Exit(EXIT_INTERRUPTED) from None
        # --json: the tokens so far are the answer (the text is their pieces; stop strings not applied)
        print_json(
            {
                "model": str(model),
                "prompt": prompt,
                "text": "".join(ev.text for ev in so_far),
                "token_ids": [ev.id for ev in so_far],
                "tokens": [ev.to_json() for ev in so_far],
                "prompt_tokens": len(ids),
                "generated_tokens": len(so_far),
                "finish_reason": "interrupted",
            }
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if json_out:
        print_json(
            {
                "model": str(model),
                "prompt": prompt,
                "chat": bool(chat or system is not None),
                "ctx": eng.ctx,
                "kv_cache": kv_cache,
                "threads": eng.threads,
                "calibration_temperature": eng.calibration_temperature,
                "sampling": dataclasses.asdict(sampling),
                **res.to_json(),
                **gen.costs_json(eng.compile_report),
                **({"moe_stats": moe_stats_json(res.expert_usage, eng.arch)} if moe_stats else {}),
            }
        )
        return
    gen.write_stdout("\n")
    _print_stats(
        res.prompt_tokens,
        res.prefill_tok_s,
        len(res.token_ids),
        res.decode_tok_s,
        res.tokens,
        eng.calibration_temperature,
        res.finish_reason,
    )
    gen.print_compile_note(eng.compile_report)
    if logprobs:
        gen.print_logprobs(res.tokens)
    if moe_stats:
        print_moe_stats(err_console, moe_stats_json(res.expert_usage, eng.arch))
    if "mtp" in res.extra:
        mtp = res.extra["mtp"]
        asked = spec.lookup_asked() or mtp_compare
        (mtp_opt.render if asked or mtp["source"] != "lookup" else mtp_opt.render_line)(err_console, mtp)
    elif "mtp_note" in res.extra:
        err_console.print(f"[dim]{res.extra['mtp_note']}[/]", highlight=False)
    gen.print_decision(res.extra)


class _Clock:
    """When generation started, and when its first and latest tokens came: the figures of
    a generation cut short, which has no result to read them from."""

    def __init__(self) -> None:
        self.t0 = self.first = self.last = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def tick(self) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last

    def prefill_tok_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / (self.first - self.t0) if self.first > self.t0 else 0.0

    def decode_tok_s(self, tokens: int) -> float:
        return (tokens - 1) / (self.last - self.first) if tokens > 1 and self.last > self.first else 0.0


def _print_stats(
    prompt_tokens: int,
    prefill_tok_s: float,
    generated: int,
    decode_tok_s: float,
    tokens: list[Any],
    calibration_temperature: float | None,
    finish: str,
) -> None:
    """The closing line on stderr: prompt, prefill and decode speed, confidence, memory, why it ended."""
    mean_conf = sum(t.confidence for t in tokens) / max(len(tokens), 1)
    calib = f" (calibrated, T={calibration_temperature:.3g})" if calibration_temperature else ""
    err_console.print(
        f"[dim]prompt[/] {prompt_tokens} tok · [dim]prefill[/] {prefill_tok_s:.1f} tok/s · "
        f"[dim]decode[/] {generated} tok, {decode_tok_s:.1f} tok/s · "
        f"[dim]mean confidence[/] {mean_conf:.2f}{calib} · [dim]peak RSS[/] {gen.peak_rss()} · "
        f"[dim]finish[/] [bold]{finish}[/]",
        highlight=False,
    )
