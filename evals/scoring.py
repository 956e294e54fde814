"""Teacher-forced logits for the scored positions of a window plan, for one or more models.

``iter_scored`` feeds each window to every model's ``iter_logits`` in lockstep and
yields only the logit rows that are scored, with their target ids, so a caller
never holds more than one block per model (memory is bounded by the engine's
``chunk`` rows, not by the text length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np

from evals.windows import Window


class LogitModel(Protocol):
    """The part of ``cortiq_engine.Engine`` the evals use."""

    vocab_size: int

    def iter_logits(
        self, ids: list[int], chunk: int = 512, sub: int | None = None, first: int = 0
    ) -> Iterator[tuple[int, np.ndarray]]: ...


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class ScoredBlock:
    window: int  # index into the plan
    positions: np.ndarray  # absolute positions of the targets, int64 [rows]
    targets: np.ndarray  # target token ids, int64 [rows]
    logits: list[np.ndarray]  # one float32 [rows, vocab] per model; row k predicts targets[k]


def iter_scored(
    models: Sequence[LogitModel],
    tokens: np.ndarray,
    windows: Sequence[Window],
    chunk: int = 512,
) -> Iterator[ScoredBlock]:
    tokens = np.asarray(tokens)  # sliced per window: the whole text is not widened
    for wi, w in enumerate(windows):
        ids = tokens[w.begin : w.end].tolist()
        if w.bos is not None:
            ids[0] = int(w.bos)
        # no logits for the rows a window only conditions on (half of a sliding window's)
        streams = [m.iter_logits(ids, chunk=chunk, first=w.row_from) for m in models]
        for blocks in zip(*streams, strict=True):
            start, first = blocks[0]
            rows = len(first)
            for s, b in blocks[1:]:
                if s != start or len(b) != rows:
                    raise RuntimeError(f"engines returned misaligned logit blocks ({s}+{len(b)} vs {start}+{rows})")
            lo, hi = max(w.row_from, start), min(w.row_to, start + rows)
            if lo >= hi:
                continue
            pos = np.arange(w.begin + lo + 1, w.begin + hi + 1, dtype=np.int64)
            yield ScoredBlock(
                wi,
                pos,
                tokens[pos].astype(np.int64),
                [np.asarray(b[lo - start : hi - start], dtype=np.float32) for _, b in blocks],
            )


def scored_text_bytes(decoder: Decoder, tokens: np.ndarray, windows: Sequence[Window]) -> int:
    """UTF-8 bytes of the scored tokens' text, decoding each contiguous run of targets once."""
    runs: list[list[int]] = []
    for w in windows:
        t = w.targets
        if runs and runs[-1][1] == t.start:
            runs[-1][1] = t.stop
        else:
            runs.append([t.start, t.stop])
    tokens = np.asarray(tokens)
    return sum(len(decoder.decode(tokens[a:b].tolist()).encode("utf-8")) for a, b in runs)


def count_scored(windows: Sequence[Window]) -> int:
    return sum(w.n_scored for w in windows)
