"""What the frozen backbone says about a text: per window of ``seq`` tokens, its
hidden rows and its next-token distribution (the teacher), computed once.

Each window is a fresh sequence for the backbone and one draft sequence for the
layers, so the draft attention never crosses a window. The teacher keeps the
top-k log-probabilities of every position; index 0 is the backbone's greedy
token, the one a draft must match to be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from formats.errors import CortiqError

HEAD_ROWS = 64  # lm_head rows per block: bounds the [rows, vocab] logits buffer


@dataclass
class Features:
    tokens: np.ndarray  # int64 [W, T]
    hidden: np.ndarray  # f32 [W, T, H]: the draft layers' hidden input (pre or post norm)
    top_idx: np.ndarray  # int32 [W, T, k]: teacher top-k at each position, best first
    top_logp: np.ndarray  # f32 [W, T, k]: their log-probabilities (not renormalized)
    train: np.ndarray  # int64: window indices used for training
    held: np.ndarray  # int64: held-out window indices

    @property
    def seq(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def greedy(self) -> np.ndarray:
        """[W, T]: the backbone's greedy token after each position."""
        return self.top_idx[:, :, 0]


def split_windows(n_tokens: int, seq: int, holdout: float, min_len: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(windows, train indices, held-out indices): the last windows are held out."""
    n = n_tokens // seq
    held_n = int(np.ceil(n * holdout)) if holdout > 0 else 0
    need = 1 + (1 if holdout > 0 else 0)
    if seq < min_len or n < need or n - held_n < 1:
        raise CortiqError(
            f"too little text: {n_tokens} tokens make {n} window(s) of --seq {seq}; need at least {need} "
            f"(give more text, or lower --seq / --holdout)"
        )
    idx = np.arange(n, dtype=np.int64)
    return n, idx[: n - held_n], idx[n - held_n :]


class EngineRunner:
    """The backbone as the engine computes it (exactly the decode path's numbers)."""

    def __init__(self, backbone):
        self.model = backbone.model

    def hidden(self, ids: np.ndarray) -> np.ndarray:
        from cortiq_engine.model import forward

        return forward(self.model.new_state(len(ids)), ids)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return self.model.final_norm(x)

    def logits(self, normed: np.ndarray) -> np.ndarray:
        return self.model.lm_head(normed)


def collect(
    runner,
    ids: list[int] | np.ndarray,
    *,
    seq: int,
    topk: int,
    hidden: str,
    holdout: float,
    min_len: int,
    progress: Callable[[int, int], None] | None = None,
) -> Features:
    ids = np.asarray(ids, dtype=np.int64)
    n, train, held = split_windows(len(ids), seq, holdout, min_len)
    x0 = runner.hidden(ids[:1])
    h = x0.shape[1]
    vocab = runner.logits(runner.final_norm(x0)).shape[1]
    k = min(topk, vocab)
    tokens = ids[: n * seq].reshape(n, seq)
    hid = np.empty((n, seq, h), np.float32)
    top_idx = np.empty((n, seq, k), np.int32)
    top_logp = np.empty((n, seq, k), np.float32)
    for w in range(n):
        x = runner.hidden(tokens[w])
        normed = runner.final_norm(x)
        hid[w] = normed if hidden == "post" else x
        for r0 in range(0, seq, HEAD_ROWS):
            logits = runner.logits(normed[r0 : r0 + HEAD_ROWS]).astype(np.float64)
            i, lp = _top_logp(logits, k)
            top_idx[w, r0 : r0 + len(i)] = i
            top_logp[w, r0 : r0 + len(i)] = lp
        if progress:
            progress(w + 1, n)
    return Features(tokens, hid, top_idx, top_logp, train, held)


def _top_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (best first, ties to the lower id like argmax) and their log-softmax values."""
    m = logits.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True))
    if k < logits.shape[1]:
        part = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(logits.shape[1]), logits.shape).copy()
    vals = np.take_along_axis(logits, part, axis=1)
    # Sort by value descending, then id ascending, so index 0 equals np.argmax.
    order = np.lexsort((part, -vals), axis=1)
    idx = np.take_along_axis(part, order, axis=1)
    # argpartition may pick any of several tied k-th values; the greedy token must be argmax's.
    idx[:, 0] = np.argmax(logits, axis=1)
    lp = np.take_along_axis(logits, idx, axis=1) - lse
    return idx.astype(np.int32), lp.astype(np.float32)
