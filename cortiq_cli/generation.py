"""What ``generate`` and ``chat`` show of a generation besides their own lines: the text as
it streams, the compilation at load and the peak RSS beside the speeds, each step's
log-probabilities (``--logprobs``) and the speculative decision."""

from __future__ import annotations

import sys
from typing import Any

import typer
from rich.markup import escape

from cortiq_cli.common import compile_note, err_console, human_bytes, peak_rss_bytes

MAX_LOGPROBS = 20  # OpenAI's bound; more is a different question (use the engine's logits)


def logprobs_option(help: str) -> Any:
    """``--logprobs N``; ``help`` says where the command lists them."""
    return typer.Option("--logprobs", min=0, max=MAX_LOGPROBS, help=help)


def write_stdout(text: str) -> None:
    """Text on stdout at once (a streamed answer's pieces, the line that ends it)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def print_compile_note(report: Any) -> None:
    """``compile_note`` as a dim line on stderr, when load compiled anything."""
    note = compile_note(report)
    if note:
        err_console.print(f"[dim]{note}[/]", highlight=False)


def costs_json(report: Any) -> dict[str, Any]:
    """The kernel compilation at load (never part of the prefill and decode figures) and
    the peak RSS so far."""
    compiled = report.to_json() if report is not None else {"compile_seconds": 0.0, "compiled_kernels": 0}
    return {**compiled, "peak_rss_bytes": peak_rss_bytes()}


def peak_rss() -> str:
    return human_bytes(peak_rss_bytes())


def print_logprobs(tokens: Any) -> None:
    """One line per step on stderr: the chosen token, then the most likely ones, with log-probabilities."""
    for k, ev in enumerate(tokens):
        alts = "  ".join(f"{escape(repr(t.text))} {t.logprob:.3f}" for t in ev.top_logprobs or [])
        err_console.print(
            f"[dim]{k:>4}[/] {escape(repr(ev.text))} [bold]{ev.logprob:.3f}[/]  [dim]|[/] {alts}", highlight=False
        )


def print_decision(extra: dict[str, Any]) -> None:
    """The speculative decision (each draft source on or off, and why), when there is one."""
    if "speculative" in extra:
        err_console.print(f"[dim]speculative: {escape(extra['speculative']['decision'])}[/]", highlight=False)
