"""The speculative-decoding options of ``cortiq generate``/``chat`` and how their results are shown.

The commands declare the options below and turn them into ``Engine.load(mtp=...)``
and ``Engine.generate(speculative=...)`` arguments; the engine loads the draft layers,
decides plain or speculative decoding and counts acceptance. ``render`` shows the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from cortiq_cli.common import load_engine, print_table
from cortiq_cli.options import OptionGroup
from formats.errors import CortiqError
from formats.sidecar import MAX_LOOKUP_DRAFTS

MTP_PANEL = "Speculative decoding (MTP layers, n-gram lookup)"

# The model argument of the commands that build a sidecar for a backbone (mtp-train, mtp-vocab).
Backbone = Annotated[Path, typer.Argument(help="The backbone CMF file (read, never changed).", show_default=False)]

MtpPath = Annotated[
    Optional[Path],
    typer.Option(
        "--mtp",
        help="MTP draft layers from this sidecar (default: inline, else MODEL.mtp.cmf beside the model when it exists).",
        rich_help_panel=MTP_PANEL,
    ),
]
NoMtp = Annotated[
    bool,
    typer.Option(
        "--no-mtp",
        help="Plain decoding: neither draft layers nor lookup drafts (with --lookup N: n-gram lookup drafts alone).",
        rich_help_panel=MTP_PANEL,
    ),
]
MtpDepth = Annotated[
    Optional[int],
    typer.Option(
        "--mtp-depth", min=1, help="Drafts per round (default: every draft layer).", rich_help_panel=MTP_PANEL
    ),
]


def chain_option(values: str, help: str) -> Any:
    """``--mtp-chain``: how depth k's draft reads the ones before it; ``values`` is its metavar."""
    return typer.Option("--mtp-chain", metavar=values, help=help, rich_help_panel=MTP_PANEL)


def hidden_option(values: str, help: str, panel: str = MTP_PANEL) -> Any:
    """``--mtp-hidden``: which backbone hidden row the drafts read; ``values`` is its metavar."""
    return typer.Option("--mtp-hidden", metavar=values, help=help, rich_help_panel=panel)


MtpChain = Annotated[
    Optional[str],
    chain_option(
        "independent|recursive",
        "independent (layer k drafts depth k+1; default when there is a layer per depth) or recursive (layer 0 on its own output).",
    ),
]
MtpHidden = Annotated[
    Optional[str],
    hidden_option("pre|post", "pre (default) or post: the backbone hidden before or after its final norm."),
]
MtpVocab = Annotated[
    Optional[str],
    typer.Option(
        "--mtp-vocab",
        metavar="N|full",
        help="Draft vocabulary: the first N ids of the sidecar's (most useful first), or full (the whole lm_head). Default: the sidecar's when it has one (`cortiq mtp-vocab` adds one), else full.",
        rich_help_panel=MTP_PANEL,
    ),
]
MtpThreshold = Annotated[
    Optional[float],
    typer.Option(
        "--mtp-threshold",
        metavar="P",
        min=0.0,
        max=0.999,
        help="Adaptive depth: a round stops drafting at the first draft whose own probability is below P (0 = off; default: the engine's measured one).",
        rich_help_panel=MTP_PANEL,
    ),
]
Lookup = Annotated[
    Optional[int],
    typer.Option(
        "--lookup",
        metavar="N",
        min=0,
        max=MAX_LOOKUP_DRAFTS,
        help="Draft N tokens by n-gram lookup in the prompt and output before asking the MTP layers each round (exact: the same verify). Default: 3 (without draft layers: lookup alone, greedy decoding only); 0 = off (plain decoding without draft layers).",
        rich_help_panel=MTP_PANEL,
    ),
]
LookupNgram = Annotated[
    Optional[str],
    typer.Option(
        "--lookup-ngram",
        metavar="MIN:MAX",
        help="Match lengths the lookup tries, longest first (default 3:5).",
        rich_help_panel=MTP_PANEL,
    ),
]
MtpGate = Annotated[
    bool,
    typer.Option(
        "--mtp-gate/--no-mtp-gate",
        help="Accepted for compatibility; each draft source is now switched on or off by its measured speed (see docs/architectures.md).",
        hidden=True,
        rich_help_panel=MTP_PANEL,
    ),
]
MtpCompare = Annotated[
    bool,
    typer.Option(
        "--mtp-compare/--no-mtp-compare",
        help="Also run plain decoding of the same prompt: checks the outputs are equal and measures the speedup.",
        rich_help_panel=MTP_PANEL,
    ),
]


def load_arg(mtp: Path | None, no_mtp: bool) -> bool | Path:
    """``Engine.load(mtp=...)`` from the flags: the given sidecar, none, or the model's own."""
    if no_mtp and mtp is not None:
        raise CortiqError("--mtp and --no-mtp contradict each other")
    return False if no_mtp else (mtp if mtp is not None else True)


def parse_ngram(text: str | None) -> tuple[int, int] | None:
    """--lookup-ngram MIN:MAX (or one number for both)."""
    if text is None:
        return None
    parts = text.replace("-", ":").split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if 1 <= len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise CortiqError(f"--lookup-ngram {text!r}: give MIN:MAX with 1 <= MIN <= MAX, e.g. 3:5")
    return lo, hi


def speculative_arg(
    no_mtp: bool,
    depth: int | None,
    chain: str | None,
    hidden: str | None,
    vocab: str | None = None,
    threshold: float | None = None,
    lookup: int | None = None,
    ngram: str | None = None,
    gate: bool = False,
):
    """``Engine.generate(speculative=...)`` from the flags (the engine decides the rest).
    --no-mtp keeps an explicit --lookup N: lookup drafts alone."""
    from cortiq_engine import SpeculativeConfig
    from cortiq_engine.draft_vocab import parse_vocab

    grams = parse_ngram(ngram)
    given = [
        f
        for f, v in (
            ("--mtp-depth", depth),
            ("--mtp-chain", chain),
            ("--mtp-hidden", hidden),
            ("--mtp-vocab", vocab),
            ("--mtp-threshold", threshold),
        )
        if v is not None
    ]
    if no_mtp and given:
        raise CortiqError(f"--no-mtp and {given[0]} contradict each other")
    if lookup == 0 and grams is not None:
        raise CortiqError("--lookup 0 and --lookup-ngram contradict each other")
    if no_mtp and grams is not None and not lookup:
        raise CortiqError("--lookup-ngram given, but no lookup drafts: add --lookup N")
    if no_mtp:
        return SpeculativeConfig(lookup=lookup, ngram=grams) if lookup else False
    return SpeculativeConfig(
        depth=depth,
        chain=chain,
        hidden=hidden,
        vocab=parse_vocab(vocab),
        threshold=threshold,
        lookup=lookup,
        ngram=grams,
        mtp_gate=gate,
    )


@dataclass(frozen=True)
class SpecArgs(OptionGroup):
    """The draft-source options ``generate`` and ``chat`` share (spread by ``options.options``)."""

    mtp: MtpPath = None
    no_mtp: NoMtp = False
    mtp_depth: MtpDepth = None
    mtp_chain: MtpChain = None
    mtp_hidden: MtpHidden = None
    mtp_vocab: MtpVocab = None
    mtp_threshold: MtpThreshold = None
    lookup: Lookup = None
    lookup_ngram: LookupNgram = None
    mtp_gate: MtpGate = False

    def load_arg(self) -> bool | Path:
        return load_arg(self.mtp, self.no_mtp)

    def load_engine(self, model: Path, *, threads: int | None, ctx: int | None, quiet: bool, kv_cache: str) -> Any:
        """The engine with the draft layers these options ask for (inline, the sidecar beside
        the model, --mtp, or none); its draft sources start from the rates measured on this
        machine before (CORTIQ_SPEC_MEMORY)."""
        from cortiq_engine.spec_decision import SpecMemory

        eng = load_engine(model, threads=threads, ctx=ctx, quiet=quiet, mtp=self.load_arg(), kv_cache=kv_cache)
        eng.spec_memory = SpecMemory.default()
        return eng

    def speculative(self):
        return speculative_arg(
            self.no_mtp,
            self.mtp_depth,
            self.mtp_chain,
            self.mtp_hidden,
            self.mtp_vocab,
            self.mtp_threshold,
            self.lookup,
            self.lookup_ngram,
            self.mtp_gate,
        )

    def lookup_asked(self) -> bool:
        return self.lookup is not None or self.lookup_ngram is not None


def describe(mtp: dict[str, Any]) -> str:
    """One line for a drafter's settings (``describe()``, or a result's ``extra["mtp"]``)."""
    parts = []
    if mtp.get("lookup"):
        lo, hi = mtp["lookup_ngram"]
        parts.append(f"lookup {mtp['lookup']} ({lo}-{hi}-grams)")
    if mtp.get("chain") is not None:
        parts.append(
            f"MTP {mtp['source']} · {mtp['chain']} chain · {mtp['hidden']}-norm hidden · "
            f"draft vocab {mtp['draft_vocab']} · threshold {mtp['threshold']:g}"
        )
    return " then ".join(parts)


def compare_with_plain(engine, res, prompt_ids, config, *, max_tokens: int, stop=(), ignore_eos: bool = False) -> None:
    """--mtp-compare: plain decoding of the same prompt beside a speculative result; adds
    the speedup and whether the tokens are the same to ``res.extra["mtp"]``."""
    mtp = res.extra["mtp"]
    plain = engine.generate(
        prompt_ids, config, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, speculative=False
    )
    spec_s = res.prefill_seconds + res.decode_seconds
    plain_s = plain.prefill_seconds + plain.decode_seconds
    mtp.update(
        decode_tok_s=res.decode_tok_s,
        plain_decode_tok_s=plain.decode_tok_s,
        same_tokens_as_plain=plain.token_ids == res.token_ids,
        same_text_as_plain=plain.text == res.text,
        decode_speedup=res.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s > 0 else 0.0,
        speedup=plain_s / spec_s if spec_s > 0 else 0.0,
    )


def render(console, mtp: dict[str, Any]) -> None:
    """The closing rich table of a speculative generation."""
    t = Table(title=f"speculative decoding · {describe(mtp)}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("rounds", f"{mtp['rounds']} (+{mtp['plain_steps']} plain steps)")
    t.add_row("tokens / round", f"{mtp['tokens_per_round']:.3f}")
    t.add_row("accepted drafts", f"{mtp['accepted']}/{mtp['drafted']} ({mtp['acceptance']:.1%})")
    t.add_row("acceptance per depth", "  ".join(f"d{i + 1} {r:.1%}" for i, r in enumerate(mtp["acceptance_per_depth"])))
    t.add_row("accepted per round", "  ".join(f"{a}: {n}" for a, n in enumerate(mtp["accept_histogram"])))
    t.add_row(
        "drafts per round",
        "  ".join(f"{a}: {n}" for a, n in enumerate(mtp["depth_histogram"])) + f"  (mean {mtp['mean_depth']:.2f})",
    )
    t.add_row("draft / verify per round", f"{mtp['draft_ms_per_round']:.1f} ms / {mtp['verify_ms_per_round']:.1f} ms")
    for name, sub in (mtp.get("by_source") or {}).items():
        t.add_row(
            f"{name} rounds",
            f"{sub['drafting_rounds']}: {sub['tokens_per_round']:.2f} tokens / round, "
            f"{sub['accepted']}/{sub['drafted']} drafts accepted, verify {sub['verify_ms_per_round']:.1f} ms",
        )
    if "speedup" in mtp:
        same = "[green]same tokens[/]" if mtp["same_tokens_as_plain"] else "[bold red]DIFFERENT tokens[/]"
        t.add_row(
            "vs plain decoding",
            f"{mtp['speedup']:.2f}x end to end, {mtp['decode_speedup']:.2f}x decode "
            f"({mtp['decode_tok_s']:.1f} vs {mtp['plain_decode_tok_s']:.1f} tok/s), {same}",
        )
    print_table(console, t)


def render_line(console, mtp: dict[str, Any]) -> None:
    """One dim line for lookup drafts nobody asked for (the default without draft layers)."""
    console.print(
        f"[dim]lookup drafts (exact; --lookup 0 turns them off): {mtp['rounds']} round{'s' * (mtp['rounds'] != 1)}, "
        f"{mtp['accepted']}/{mtp['drafted']} drafts accepted, {mtp['tokens_per_round']:.2f} tokens per step[/]",
        highlight=False,
    )


def with_lookup_line(rec: dict[str, Any]) -> str:
    """One line for a defaults record's ``with_lookup`` setting ("" without one)."""
    wl = rec.get("with_lookup")
    if not wl:
        return ""
    return (
        f"with n-gram lookup drafting first (--lookup {wl['lookup']}, the default): depth {wl['depth']}, "
        f"threshold {wl['threshold']:g}: modelled {wl['modelled_speedup']:.2f}x plain decoding, "
        f"{wl['lookup_rounds']} of {wl['rounds']} rounds drafted by lookup"
    )
