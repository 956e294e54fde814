"""The speculative-decoding options of ``cortiq generate`` and how their results are shown.

``cmd_generate`` declares the options below, calls ``resolve`` once the engine is
loaded, and, when it returns a drafter, generates through
``cortiq_engine.speculative`` and shows ``render`` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from cortiq_cli.common import print_table
from formats.errors import CortiqError

MTP_PANEL = "Speculative decoding (MTP)"

MtpPath = Annotated[
    Optional[Path],
    typer.Option("--mtp", help="MTP draft layers from this sidecar (default: inline, else MODEL.mtp.cmf beside the model when it exists).", rich_help_panel=MTP_PANEL),
]
NoMtp = Annotated[bool, typer.Option("--no-mtp", help="Plain decoding even when draft layers are present.", rich_help_panel=MTP_PANEL)]
MtpDepth = Annotated[Optional[int], typer.Option("--mtp-depth", min=1, help="Drafts per round (default: every draft layer).", rich_help_panel=MTP_PANEL)]
MtpChain = Annotated[
    Optional[str],
    typer.Option("--mtp-chain", help="independent (layer k drafts depth k+1; default when there is a layer per depth) or recursive (layer 0 on its own output).", rich_help_panel=MTP_PANEL),
]
MtpHidden = Annotated[str, typer.Option("--mtp-hidden", help="pre or post: the backbone hidden before or after its final norm.", rich_help_panel=MTP_PANEL)]
MtpCompare = Annotated[
    bool,
    typer.Option("--mtp-compare/--no-mtp-compare", help="Also run plain decoding of the same prompt: checks the outputs are equal and measures the speedup.", rich_help_panel=MTP_PANEL),
]


@dataclass
class Speculation:
    drafter: Any  # cortiq_engine.mtp.Drafter


def resolve(engine, *, mtp: Path | None, no_mtp: bool, depth: int | None, chain: str | None, hidden: str,
            greedy: bool, evict: bool) -> tuple[Speculation | None, str]:
    """(the drafter to decode with or None, a one-line note on why not when there is none).

    A sidecar that exists but does not fit the backbone raises, whatever the sampling.
    """
    from cortiq_engine.mtp import load_draft_stack, make_drafter

    if no_mtp:
        if mtp is not None:
            raise CortiqError("--mtp and --no-mtp contradict each other")
        return None, ""
    stack = load_draft_stack(engine.cmf, engine.arch, engine.kernels, path=mtp)
    if stack is None:
        if depth is not None or chain is not None:
            raise CortiqError(
                f"{engine.path}: no MTP draft layers (none inline, no sidecar beside it); train them with "
                f"`cortiq mtp-train {engine.path}`, or give --mtp PATH"
            )
        return None, ""
    if not greedy:
        return None, "speculative decoding is off: it is exact for greedy decoding only (temperature 0)"
    if evict:
        return None, "speculative decoding is off with --evict"
    return Speculation(make_drafter(engine.model, stack, engine.ctx, depth=depth, chain=chain, hidden=hidden)), ""


def generate(engine, prompt_ids, spec: Speculation, config, *, max_tokens: int, stop=(), compare: bool = False,
             ignore_eos: bool = False, on_token=None, on_text=None, logprobs: int = 0, state=None):
    """Speculative generation; with ``compare`` also plain decoding of the same prompt,
    so ``result.extra["mtp"]`` carries the speedup and whether the tokens are the same."""
    from cortiq_engine.speculative import generate_with_engine

    eos = () if ignore_eos else engine.eos_ids
    res = generate_with_engine(engine, prompt_ids, spec.drafter, max_tokens=max_tokens, stop=stop, eos_ids=eos,
                               config=config, on_token=on_token, on_text=on_text, logprobs=logprobs, state=state)
    mtp = res.extra["mtp"]
    mtp["decode_tok_s"] = res.decode_tok_s
    if compare:
        plain = engine.generate(prompt_ids, config, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos)
        spec_s = res.prefill_seconds + res.decode_seconds
        plain_s = plain.prefill_seconds + plain.decode_seconds
        mtp.update(
            plain_decode_tok_s=plain.decode_tok_s,
            same_tokens_as_plain=plain.token_ids == res.token_ids,
            decode_speedup=res.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s > 0 else 0.0,
            speedup=plain_s / spec_s if spec_s > 0 else 0.0,
        )
    return res


def render(console, mtp: dict[str, Any]) -> None:
    """The closing rich table of a speculative generation."""
    t = Table(title=f"speculative decoding · {mtp['chain']} chain · {mtp['hidden']}-norm hidden · {mtp['source']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("rounds", f"{mtp['rounds']} (+{mtp['plain_steps']} plain steps)")
    t.add_row("tokens / round", f"{mtp['tokens_per_round']:.3f}")
    t.add_row("accepted drafts", f"{mtp['accepted']}/{mtp['drafted']} ({mtp['acceptance']:.1%})")
    t.add_row("acceptance per depth", "  ".join(f"d{i + 1} {r:.1%}" for i, r in enumerate(mtp["acceptance_per_depth"])))
    t.add_row("accepted per round", "  ".join(f"{a}: {n}" for a, n in enumerate(mtp["accept_histogram"])))
    t.add_row("draft / verify per round", f"{mtp['draft_ms_per_round']:.1f} ms / {mtp['verify_ms_per_round']:.1f} ms")
    if "speedup" in mtp:
        same = "[green]same tokens[/]" if mtp["same_tokens_as_plain"] else "[bold red]DIFFERENT tokens[/]"
        t.add_row(
            "vs plain decoding",
            f"{mtp['speedup']:.2f}x end to end, {mtp['decode_speedup']:.2f}x decode "
            f"({mtp['decode_tok_s']:.1f} vs {mtp['plain_decode_tok_s']:.1f} tok/s), {same}",
        )
    print_table(console, t)
