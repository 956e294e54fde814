"""Collecting an importance matrix: the mean squared input activation of every
weight column over real text (``cortiq imatrix``; the file format is ``formats.imatrix``).

``RecordingKernels`` wraps a kernel set: each matmul adds the squared columns of
its input to every weight it multiplies, then runs the inner kernel set unchanged,
so the forward pass and its numbers are those of plain inference.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

import numpy as np

from cortiq_engine.engine import open_trunk
from cortiq_engine.model import forward


class RecordingKernels:
    """A kernel set that records per-weight input-column energy and delegates everything."""

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

    def means(self) -> dict[str, np.ndarray]:
        return {k: (v / max(self.rows[k], 1)).astype(np.float32) for k, v in self.sums.items()}


def collect_imatrix(
    path: str | os.PathLike,
    windows: Iterable[Sequence[int]],
    threads: int | None = None,
    kernels: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """Run each token window through the model at ``path`` (the lm_head included) and
    return (CMF weight name -> mean squared input f32[cols], token positions seen)."""
    trunk = open_trunk(path, threads=threads, kernels=kernels, wrap_kernels=RecordingKernels, tokenizer=False)
    model, rec = trunk.model, trunk.model.kernels
    try:
        tokens = 0
        for ids in windows:
            arr = np.asarray(ids, dtype=np.int64)
            state = model.new_state(int(arr.size))
            h = model.final_norm(forward(state, arr))
            for j in range(0, h.shape[0], 64):
                model.lm_head(h[j : j + 64])
            tokens += int(arr.size)
            if progress:
                progress(int(arr.size))
    finally:
        trunk.cmf.close()
    return rec.means(), tokens
