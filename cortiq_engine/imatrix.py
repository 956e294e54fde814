"""Collecting an importance matrix: the mean squared input activation of every
weight column over real text (``cortiq imatrix``; the file format is ``formats.imatrix``).

``RecordingKernels`` wraps a kernel set: each matmul adds the squared columns of
its input to every weight it multiplies, then runs the inner kernel set unchanged,
so the forward pass and its numbers are those of plain inference.

Each window's sums are taken as one ``ImatrixPartial`` and the partials are added
in window order (``ImatrixAccumulator``): the reduction order depends on the window
plan alone, so windows scored elsewhere (``evals.cluster``) and added in the same
order give the same file, bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from cortiq_engine.engine import open_trunk
from cortiq_engine.model import forward

LM_HEAD_ROWS = 64  # the lm_head runs on this many rows at a time (its input energy is recorded)


@dataclass
class ImatrixPartial:
    """One window's recording: per weight, the f64 sum of its squared input columns and
    the rows they came from, and the token positions the window fed."""

    sums: dict[str, np.ndarray]
    rows: dict[str, int]
    tokens: int


class RecordingKernels:
    """A kernel set that records per-weight input-column energy and delegates everything."""

    # Every matmul must pass through ``matmul`` to be recorded, so a model on this set runs
    # layer by layer: no fused steps (``model.fused_stack`` asks for ``int_plans``).
    int_plans = None

    def __init__(self, inner):
        self.inner = inner
        self.sums: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def matmul(self, ws, X: np.ndarray) -> np.ndarray:
        x64 = np.asarray(X, dtype=np.float64)
        energy = np.einsum("ij,ij->j", x64, x64)
        for w in ws:
            acc = self.sums.get(w.name)
            if acc is None:
                self.sums[w.name] = energy.copy()
                self.rows[w.name] = X.shape[0]
            else:
                acc += energy
                self.rows[w.name] += X.shape[0]
        return self.inner.matmul(ws, X)

    def take(self, tokens: int) -> ImatrixPartial:
        """What was recorded since the last ``take`` (one window's), and start afresh."""
        part = ImatrixPartial(self.sums, self.rows, tokens)
        self.sums, self.rows = {}, {}
        return part

    def means(self) -> dict[str, np.ndarray]:
        return {k: (v / max(self.rows[k], 1)).astype(np.float32) for k, v in self.sums.items()}


@dataclass
class ImatrixAccumulator:
    """Window partials added in the order given (the plan's): f64 sums, then means."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    tokens: int = 0

    def add(self, part: ImatrixPartial) -> None:
        for name, s in part.sums.items():
            acc = self.sums.get(name)
            if acc is None:
                self.sums[name] = np.array(s, dtype=np.float64)
                self.rows[name] = part.rows[name]
            else:
                acc += s
                self.rows[name] += part.rows[name]
        self.tokens += part.tokens

    def means(self) -> dict[str, np.ndarray]:
        return {k: (v / max(self.rows[k], 1)).astype(np.float32) for k, v in self.sums.items()}


def open_recording(path: str | os.PathLike, threads: int | None = None, kernels: str | None = None):
    """The model at ``path`` on a ``RecordingKernels`` (a ``Trunk``: close its ``cmf``)."""
    return open_trunk(path, threads=threads, kernels=kernels, wrap_kernels=RecordingKernels, tokenizer=False)


def run_window(model, ids: Sequence[int]) -> int:
    """Feed one window through ``model`` (the lm_head included) on a fresh state; its
    recorder adds what it saw. Returns the token positions fed."""
    arr = np.asarray(ids, dtype=np.int64)
    state = model.new_state(int(arr.size))
    h = model.final_norm(forward(state, arr))
    for j in range(0, h.shape[0], LM_HEAD_ROWS):
        model.lm_head(h[j : j + LM_HEAD_ROWS])
    return int(arr.size)


def window_partial(model, ids: Sequence[int]) -> ImatrixPartial:
    """One window's ``ImatrixPartial`` (``model`` runs on a ``RecordingKernels``)."""
    return model.kernels.take(run_window(model, ids))


def collect_imatrix(
    path: str | os.PathLike,
    windows: Iterable[Sequence[int]],
    threads: int | None = None,
    kernels: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """Run each token window through the model at ``path`` (the lm_head included) and
    return (CMF weight name -> mean squared input f32[cols], token positions seen)."""
    trunk = open_recording(path, threads=threads, kernels=kernels)
    acc = ImatrixAccumulator()
    try:
        for ids in windows:
            part = window_partial(trunk.model, ids)
            acc.add(part)
            if progress:
                progress(part.tokens)
    finally:
        trunk.cmf.close()
    return acc.means(), acc.tokens
