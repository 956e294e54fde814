"""Which tokens each forward pass sees and which of its predictions are scored.

Two plans over a token sequence ``t[0..n)``:

* ``sliding_windows`` (the HF perplexity guide): windows of up to ``ctx`` tokens
  starting every ``stride`` tokens; each window scores only the tokens the
  previous window did not reach, so every token but ``t[0]`` is scored exactly
  once, with at least ``ctx - stride`` tokens of context (all of them near the start).
  (With ``stride == ctx`` the windows are disjoint and, as in the guide, the first
  token of each window is not scored: nothing in that window predicts it.)
* ``chunk_windows`` (llama.cpp ``llama-perplexity``): non-overlapping windows of
  exactly ``ctx`` tokens; each scores the targets at window positions
  ``ctx//2 + 1 .. ctx-1`` (``ctx - ctx//2 - 1`` tokens). With ``bos`` the first
  token of every window is *replaced* (not preceded) by BOS, as llama.cpp does
  for vocabularies that add BOS.

A window's logit row ``r`` predicts ``t[begin + r + 1]``; the scored rows are
``row_from .. row_to - 1``.

``DEFAULT_MODE`` is the one default of every command that plans windows (``ppl``,
``calibrate``, ``quant-sweep``, ``imatrix``): llama.cpp's chunks, so their figures
agree with each other on the same text and compare with ``llama-perplexity``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from formats.errors import CortiqError

MODES = ("chunks", "sliding")
DEFAULT_MODE = "chunks"
DEFAULT_CTX = 512


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed
    end: int  # one past the last token fed
    row_from: int  # first scored logit row (window-relative)
    row_to: int  # one past the last scored row
    bos: int | None = None  # replace the first fed token with this id

    @property
    def n_scored(self) -> int:
        return self.row_to - self.row_from

    @property
    def targets(self) -> slice:
        """Absolute positions of the scored target tokens."""
        return slice(self.begin + self.row_from + 1, self.begin + self.row_to + 1)

    def fed(self, tokens: Sequence[int]) -> list[int]:
        """The token ids the window feeds (its first replaced by ``bos`` when set)."""
        ids = [int(t) for t in tokens[self.begin : self.end]]
        if self.bos is not None:
            ids[0] = int(self.bos)
        return ids


@dataclass(frozen=True)
class WindowSettings:
    mode: str
    ctx: int
    stride: int | None  # sliding only (resolved: ctx // 2 by default)
    max_tokens: int | None
    chunks: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_settings(
    mode: str | None,
    ctx: int | None,
    stride: int | None,
    max_tokens: int | None,
    chunks: int | None,
    saved: dict[str, Any] | None = None,
) -> WindowSettings:
    """The window options (``DEFAULT_MODE``, ``DEFAULT_CTX`` when not given); with a saved
    reference's settings, those not given are the reference's."""
    saved = saved or {}

    def pick(given: Any, key: str, default: Any) -> Any:
        if given is not None:
            return given
        v = saved.get(key, default)
        return default if isinstance(v, bool) else v

    mode = pick(mode, "mode", DEFAULT_MODE)
    ctx = pick(ctx, "ctx", DEFAULT_CTX)
    if mode not in MODES:
        raise CortiqError(f"unknown --mode {str(mode)[:40]!r}; choose one of {', '.join(MODES)}")
    if not isinstance(ctx, int) or ctx < 2:
        raise CortiqError(f"--ctx must be an integer >= 2 (got {str(ctx)[:40]})")
    if mode == "sliding":
        if chunks is not None:
            raise CortiqError("--chunks applies to --mode chunks")
        stride = pick(stride, "stride", None)
        stride = stride if stride is not None else max(1, ctx // 2)
        chunks_v = None
    else:
        if stride is not None:
            raise CortiqError("--stride applies to --mode sliding (give --mode sliding); chunks never overlap")
        chunks_v = pick(chunks, "chunks", None)
    max_tokens = pick(max_tokens, "max_tokens", None)
    for name, v in (("stride", stride), ("max_tokens", max_tokens), ("chunks", chunks_v)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise CortiqError(f"--{name.replace('_', '-')} must be a positive integer (got {str(v)[:40]})")
    return WindowSettings(mode, ctx, stride, max_tokens, chunks_v)


def plan_windows(s: WindowSettings, n_tokens: int, bos: int | None) -> list[Window]:
    """The windows ``s`` plans over ``n_tokens`` tokens; ``bos`` is the chunk BOS (``evals.tokens.chunk_bos``)."""
    if s.mode == "sliding":
        return sliding_windows(n_tokens, s.ctx, s.stride, s.max_tokens)
    return chunk_windows(n_tokens, s.ctx, bos=bos, max_scored=s.max_tokens, max_chunks=s.chunks)


def sliding_windows(n_tokens: int, ctx: int, stride: int | None = None, max_scored: int | None = None) -> list[Window]:
    """The HF guide's strided sliding window; ``stride`` defaults to ``ctx`` (disjoint windows)."""
    stride = ctx if stride is None else stride
    if ctx < 2:
        raise CortiqError(f"--ctx must be at least 2 (got {ctx})")
    if not 1 <= stride <= ctx:
        raise CortiqError(f"--stride must be between 1 and --ctx ({ctx}); got {stride}")
    _need_two(n_tokens)
    last = n_tokens if max_scored is None else min(n_tokens, max_scored + 1)
    out: list[Window] = []
    scored_to = 1  # targets before this position are already scored (t[0] never is)
    begin = 0
    while scored_to < last:
        end = min(begin + ctx, last)
        # With stride == ctx the window's first token has no prediction in it: unscored, as in the guide.
        row_from = max(scored_to - 1 - begin, 0)
        if row_from < end - 1 - begin:
            out.append(Window(begin, end, row_from, end - 1 - begin))
        scored_to = end
        begin += stride
    return out


def chunk_windows(
    n_tokens: int, ctx: int, bos: int | None = None, max_scored: int | None = None, max_chunks: int | None = None
) -> list[Window]:
    """llama.cpp's chunks: ``n_tokens // ctx`` windows, second half of each scored."""
    if ctx < 4:
        raise CortiqError(f"--ctx must be at least 4 in chunk mode (got {ctx})")
    _need_two(n_tokens)
    n_chunks = n_tokens // ctx
    if n_chunks < 1:
        raise CortiqError(f"chunk mode needs at least --ctx={ctx} tokens; the text has {n_tokens} (lower --ctx)")
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    first = ctx // 2
    out: list[Window] = []
    budget = max_scored
    for i in range(n_chunks):
        row_to = ctx - 1
        if budget is not None:
            row_to = min(row_to, first + budget)
            if row_to <= first:
                break
            budget -= row_to - first
        out.append(Window(i * ctx, (i + 1) * ctx, first, row_to, bos))
    return out


def _need_two(n_tokens: int) -> None:
    if n_tokens < 2:
        raise CortiqError(f"the text has {n_tokens} token{'s' if n_tokens != 1 else ''}; scoring needs at least 2")
