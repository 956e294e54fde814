"""Row-exactness as a declared capability of a kernel set.

A kernel set declares ``row_exact_rows``: up to that many rows, its ``matmul`` and
``attend`` give every row of a k-row call bit for bit what a one-row call gives.
Exact speculative decoding needs it: the verify forwards the pending token and the
drafts as one batch, and each row must reproduce single-token decode to the bit, or
a near-tie argmax could flip. BLAS does not promise that (a 1-row and a 4-row f32
product may differ in the last bits); the numba set's small-batch kernels compute
each row on their own and declare it natively. ``RowExact`` gives any set the
capability up to ``rows`` by running the calls it cannot vouch for row by row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cortiq_engine.kernels.reference import AttentionCall
from cortiq_engine.weights import Weight


class RowExact:
    """``kernels`` with ``matmul``/``attend`` row-exact for calls of up to ``rows`` rows.

    Calls the inner set already declares exact, and calls longer than ``rows``
    (prefill, which has no one-row counterpart to match), go straight through.
    Every other operation is the inner set's: they work row by row already.
    """

    def __init__(self, kernels, rows: int):
        self.inner = kernels
        self.row_exact_rows = max(int(rows), int(kernels.row_exact_rows))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _split(self, n: int) -> bool:
        return self.inner.row_exact_rows < n <= self.row_exact_rows

    def matmul(self, ws: Sequence[Weight], X: np.ndarray) -> np.ndarray:
        if not self._split(X.shape[0]):
            return self.inner.matmul(ws, X)
        # A fresh 1-row array per call, as decode passes: BLAS may pick its kernel by alignment.
        return np.concatenate([self.inner.matmul(ws, X[i : i + 1].copy()) for i in range(X.shape[0])])

    def attend(self, q, kc, vc, start: int, call: AttentionCall | int, scale=None, sinks=None) -> np.ndarray:
        call = AttentionCall.of(call, scale, sinks)
        n = q.shape[0]
        # a capped call the reference already runs row by row (``reference.attend``)
        if call.softcap or not self._split(n):
            return self.inner.attend(q, kc, vc, start, call)
        return np.concatenate([self.inner.attend(q[i : i + 1].copy(), kc, vc, start + i, call) for i in range(n)])
