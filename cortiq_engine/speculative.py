"""Row-exact batched verification for speculative decoding.

The speculative loop itself is ``cortiq_engine.generate.generate`` with a drafter:
it verifies ``[x_{t+1}, d_1..d_K]`` in one batched backbone forward and keeps the
plain greedy stream token for token. That needs the batched verify to give each row
exactly the numbers a single-token decode gives; ``row_exact`` arranges it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np

# Query rows up to which the compiled attention computes each row on its own.
_ROW_EXACT_ATTN = 16


@contextmanager
def row_exact(kernels) -> Iterator[None]:
    """Within the scope, a batched matmul/attention gives every row bit for bit what a
    one-row call gives (decode). BLAS does not promise that: a 1-row and a 4-row f32
    product may differ in the last bits, enough to flip a near-tie argmax. The numba
    small-batch kernels accumulate each row on its own, so they keep the batch; f32
    (BLAS) and large batches go row by row. Overrides live on the kernel object only
    for the scope.
    """
    inner_matmul, inner_attend = kernels.matmul, kernels.attend
    small_n = int(getattr(kernels, "small_n", 0))
    compiled = getattr(kernels, "name", "") == "numba"

    def matmul(ws, X):
        n = X.shape[0]
        if n == 1 or (compiled and n <= small_n and not any(w.kind.native for w in ws)):
            return inner_matmul(ws, X)
        out = np.empty((n, sum(w.rows for w in ws)), np.float32)
        for i in range(n):
            out[i] = inner_matmul(ws, X[i : i + 1].copy())[0]
        return out

    def attend(q, kc, vc, start, window, scale):
        n = q.shape[0]
        if n == 1 or (compiled and n <= _ROW_EXACT_ATTN):
            return inner_attend(q, kc, vc, start, window, scale)
        return np.concatenate([inner_attend(q[i : i + 1].copy(), kc, vc, start + i, window, scale) for i in range(n)])

    kernels.matmul, kernels.attend = matmul, attend
    try:
        yield
    finally:
        del kernels.matmul, kernels.attend
