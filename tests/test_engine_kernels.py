"""The fast (numba) kernel set against the numpy reference, op by op, and the
reference against plainly written float64 math."""

from __future__ import annotations

import numpy as np
import pytest

from formats.quants import get_dtype
from cortiq_engine.kernels import get_kernels
from cortiq_engine.kernels.fast import SMALL_N
from cortiq_engine.weights import Weight

RNG = np.random.default_rng(0)


def _weight(dtype: str, rows: int, cols: int, seed: int = 0) -> tuple[Weight, np.ndarray]:
    """A Weight of ``dtype`` and its exact f32 values (decoded from the same bytes)."""
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    dt = get_dtype(dtype)
    parts = dt.named(dt.encode(x), (rows, cols))
    parts = {k: (v.view(np.uint16) if v.dtype == np.float16 else v) for k, v in parts.items()}
    if dtype in ("f32", "f16", "bf16"):
        parts["data"] = parts["data"].reshape(rows, cols)
    w = Weight("w", dtype, rows, cols, parts)
    return w, w.dequantize()


@pytest.mark.parametrize("dtype", ["q8", "q4", "f16", "bf16", "f32"])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 40])
def test_matmul_fused_fast_equals_reference_and_exact(dtype, n):
    cols = 96 if dtype in ("q8", "q4") else 70  # half types: a width that is not a multiple of 32
    ws = [_weight(dtype, r, cols, seed=i) for i, r in enumerate((50, 17, 33))]
    X = RNG.standard_normal((n, cols)).astype(np.float32)
    exact = X.astype(np.float64) @ np.concatenate([d for _, d in ws]).astype(np.float64).T
    fast = get_kernels("numba-float").matmul([w for w, _ in ws], X)
    ref = get_kernels("numpy").matmul([w for w, _ in ws], X)
    scale = np.abs(exact).max()
    assert np.abs(ref - exact).max() / scale < 1e-5
    assert np.abs(fast - exact).max() / scale < 1e-5
    if dtype not in ("q8", "q4") or n > SMALL_N:
        # float activations here too (q8/q4 decode batches: int8, tests/test_qdot.py)
        default = get_kernels("numba").matmul([w for w, _ in ws], X)
        assert np.abs(default - exact).max() / scale < 1e-5


def test_matmul_mixed_dtypes_in_one_call():
    a, da = _weight("q8", 20, 64, 1)
    b, db = _weight("f32", 7, 64, 2)
    c, dc = _weight("q4", 11, 64, 3)
    X = RNG.standard_normal((2, 64)).astype(np.float32)
    out = get_kernels("numba-float").matmul([a, b, c], X)
    np.testing.assert_allclose(out, X @ np.concatenate([da, db, dc]).T, rtol=1e-4, atol=1e-4)
    # int8 activations: each matrix of the fused call gives what it gives alone
    ks = get_kernels("numba")
    fused = ks.matmul([a, b, c], X)
    assert np.array_equal(fused, np.concatenate([ks.matmul([w], X) for w in (a, b, c)], axis=1))


def _attention64(q, kc, vc, start, window, scale):
    n, heads, d = q.shape
    group = heads // kc.shape[0]
    out = np.zeros((n, heads, vc.shape[2]))
    for i in range(n):
        hi = start + i + 1
        lo = max(0, hi - window) if window else 0
        for h in range(heads):
            k = kc[h // group, lo:hi].astype(np.float64)
            s = k @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ vc[h // group, lo:hi]
    return out


@pytest.mark.parametrize("n", [1, 5, 30])
@pytest.mark.parametrize("window", [0, 4])
def test_attention(n, window):
    heads, kvh, d, dv, cap, start = 6, 2, 16, 12, 64, 9
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, cap, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, cap, dv)).astype(np.float32)
    exact = _attention64(q, kc, vc, start, window, d**-0.5)
    for name in ("numba", "numpy"):
        got = get_kernels(name).attend(q, kc, vc, start, window, d**-0.5)
        np.testing.assert_allclose(got, exact, atol=1e-5)


def test_norms_rope_silu():
    fast, ref = get_kernels("numba"), get_kernels("numpy")
    x = RNG.standard_normal((5, 40)).astype(np.float32)
    w = RNG.standard_normal(40).astype(np.float32)
    exact = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6)
    for ks in (fast, ref):
        np.testing.assert_allclose(ks.rms_norm(x, w, 1e-6), exact, rtol=1e-5, atol=1e-6)
        x1, d = x.copy(), RNG.standard_normal((5, 40)).astype(np.float32)
        got = ks.add_rms_norm(x1, d, w, 1e-6)
        np.testing.assert_allclose(x1, x + d, rtol=1e-6)
        np.testing.assert_allclose(got, ref.rms_norm(x + d, w, 1e-6), rtol=1e-5, atol=1e-6)
        gu = RNG.standard_normal((3, 8)).astype(np.float32)
        g, u = gu[:, :4].astype(np.float64), gu[:, 4:]
        np.testing.assert_allclose(ks.silu_mul(gu), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
        # rope: rotating by the angle of position p twice equals rotating by 2p (per pair).
        xr = RNG.standard_normal((2, 3, 8)).astype(np.float32)
        ang = np.array([[0.3, 1.1, 0.0, 2.0], [0.5, 0.25, 1.0, 3.0]], np.float32)
        y = xr.copy()
        ks.rope(y, np.cos(ang), np.sin(ang))
        a, b = xr[..., :4], xr[..., 4:]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        np.testing.assert_allclose(y, np.concatenate([a * c - b * s, b * c + a * s], -1), rtol=1e-5, atol=1e-6)
