"""A plain pre-norm stack's decode and verify steps as one compiled call.

A decode step of SmolLM2 makes ~12 kernel calls per layer from Python (norm, the fused
q|k|v matmul, two RoPEs, the cache write, attention, o, the residual norm, gate|up, the
activation, down, the residual add): ~360 numba dispatches and their Python glue, about
a quarter of the step. ``prenorm_step`` runs every layer in one call on the same
compiled kernels (``qdot.intdot``, ``jit.rms_norm``, ``jit.rope``, ``jit.attend``, ...),
in the same order on the same arrays, so its rows are the layer-by-layer path's rows
(``tests/test_fused.py`` holds them equal bit for bit, one row and a verify's rows).

``FusedStack`` is what a stack needs for it, built once per model by the kernel set
(``NumbaKernels.fused_stack``): every layer's four matmul plans packed into arrays, the
norm weights stacked. A stack qualifies when every block is the plain pre-norm one
(``layers.Block`` over ``layers.Attention`` and a SiLU ``layers.GatedMLP``, no biases,
q/k norms, gates, soft-caps or sinks, one RoPE) and every matmul runs on the integer
kernels; everything else, an f16 cache and more rows than the verify's take the
layer-by-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from cortiq_engine.kernels import jit, qdot

# The four matmuls of a layer, in plan order.
QKV, O, GATE_UP, DOWN = range(4)


@dataclass(frozen=True, eq=False)
class FusedStack:
    """One stack's arrays for ``prenorm_step`` (L layers, the four matmuls of each)."""

    fn: np.ndarray  # int64 [L, 4]: the integer kernel's address
    addrs: np.ndarray  # int64 [L, 4, FUSE_MAX, NPARTS]: each fused matrix's part addresses
    rows: np.ndarray  # int64 [L, 4, FUSE_MAX]
    count: np.ndarray  # int64 [L, 4]: matrices fused in the call
    offs: np.ndarray  # int64 [L, 4, FUSE_MAX + 1]: their first output columns
    qmax: np.ndarray  # int64 [L, 4]: the activations' largest integer
    zmm: np.ndarray  # bool [L, 4]: the kernel reads interleaved rows
    bits: np.ndarray  # int64 [L, 4]: activation width, 8 or 16
    widths: np.ndarray  # int64 [L, 4]: output columns
    norms: np.ndarray  # f32 [L, 2, hidden]: attention and MLP norm weights
    eps: np.ndarray  # f32 [L, 2]
    windows: np.ndarray  # int64 [L]: sliding window (0: none)
    heads: tuple[int, int, int]  # query heads, KV heads, head size
    scale: float
    rope: object  # the one layers.RoPE every layer shares
    fns: np.ndarray  # int64: the attention's IR loops (attn_ir), or zeros
    keep: tuple  # the plans whose arrays ``addrs`` points into


_P8, _P16 = np.empty(0, np.int8), np.empty(0, np.int16)


@njit(inline="always")
def _matmul(f, layer, j, X, out):  # pragma: no cover - compiled
    a = (f[0][layer, j], f[1][layer, j], f[2][layer, j], f[3][layer, j], f[4][layer, j])
    if f[7][layer, j] == 8:
        qdot.intdot(a[0], a[1], a[2], a[3], a[4], X, _P8, f[5][layer, j], f[6][layer, j], out)
    else:
        qdot.intdot(a[0], a[1], a[2], a[3], a[4], X, _P16, f[5][layer, j], f[6][layer, j], out)


@njit(cache=True)
def prenorm_step(
    x,
    fn,
    addrs,
    rows,
    count,
    offs,
    qmax,
    zmm,
    bits,
    widths,
    norms,
    eps,
    windows,
    nh,
    nkv,
    hd,
    scale,
    cos,
    sin,
    fns,
    keys,
    values,
    start,
):  # pragma: no cover - compiled
    """Advance the residual rows ``x`` [n, hidden] through every layer in place; the new
    keys and values go to rows start..start+n-1 of each layer's cache (keys[l], values[l])."""
    n = x.shape[0]
    f = (fn, addrs, rows, count, offs, qmax, zmm, bits)
    nq, nk = nh * hd, nkv * hd
    h = np.empty_like(x)
    for layer in range(norms.shape[0]):
        jit.rms_norm(x, norms[layer, 0], eps[layer, 0], h)
        qkv = np.empty((n, widths[layer, QKV]), np.float32)
        _matmul(f, layer, QKV, h, qkv)
        q = np.ascontiguousarray(qkv[:, :nq]).reshape(n, nh, hd)
        k = np.ascontiguousarray(qkv[:, nq : nq + nk]).reshape(n, nkv, hd)
        jit.rope(q, cos, sin)
        jit.rope(k, cos, sin)
        kc, vc = keys[layer], values[layer]
        for i in range(n):
            for g in range(nkv):
                kc[g, start + i] = k[i, g]
                vc[g, start + i] = qkv[i, nq + nk + g * hd : nq + nk + (g + 1) * hd]
        o = np.empty((n, nh, hd), np.float32)
        jit.attend(q, kc, vc, start, windows[layer], scale, None, o, fns)
        a = np.empty((n, widths[layer, O]), np.float32)
        _matmul(f, layer, O, o.reshape(n, nq), a)
        jit.add_rms_norm(x, a, norms[layer, 1], eps[layer, 1], h)
        gu = np.empty((n, widths[layer, GATE_UP]), np.float32)
        _matmul(f, layer, GATE_UP, h, gu)
        act = np.empty((n, widths[layer, GATE_UP] // 2), np.float32)
        jit.silu_mul(gu, act)
        d = np.empty((n, widths[layer, DOWN]), np.float32)
        _matmul(f, layer, DOWN, act, d)
        x += d


def run(stack: FusedStack, x: np.ndarray, caches, start: int, cos: np.ndarray, sin: np.ndarray) -> None:
    """``prenorm_step`` over ``caches`` (one f32 ``KVCache`` per layer, each ``start`` rows long)."""
    s = stack
    nh, nkv, hd = s.heads
    prenorm_step(
        x,
        s.fn,
        s.addrs,
        s.rows,
        s.count,
        s.offs,
        s.qmax,
        s.zmm,
        s.bits,
        s.widths,
        s.norms,
        s.eps,
        s.windows,
        nh,
        nkv,
        hd,
        np.float32(s.scale),
        cos,
        sin,
        s.fns,
        tuple(c.keys for c in caches),
        tuple(c.values for c in caches),
        start,
    )
