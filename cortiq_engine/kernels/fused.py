"""A dense stack's decode and verify steps as one compiled call.

A decode step of SmolLM2 makes ~12 kernel calls per layer from Python (norm, the fused
q|k|v matmul, two RoPEs, the cache write, attention, o, the residual norm, gate|up, the
activation, down, the residual add): ~360 numba dispatches and their Python glue, about
a quarter of the step. ``fused_step`` runs every layer in one call on the same compiled
kernels (``qdot.intdot``, ``jit.rms_norm``, ``jit.rope``, ``jit.attend``, ...), in the
same order on the same arrays, so its rows are the layer-by-layer path's rows
(``tests/test_fused.py`` holds them equal bit for bit, one row and a verify's rows).

``FusedStack`` is what a stack needs for it, built once per model (``model.fused_stack``):
every layer's four matmul plans packed into arrays, the norm weights stacked. Two block
shapes qualify: the pre-norm ``layers.Block`` (Llama, SmolLM2, Mistral) and the sandwich
``layers.SandwichBlock`` with all four norms (Gemma 3), over ``layers.Attention`` (per-head
q/k norms allowed; no biases, gates, soft-caps or sinks; RoPE on every layer, one table
per distinct RoPE) and a SiLU or tanh-GELU ``layers.GatedMLP``, every matmul on the
integer kernels, over an f32 or an f16 KV cache (a row is rounded to f16 as it enters
the cache, to nearest with ties to even as numpy rounds it). Everything else and more
rows than a verify's take the layer-by-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from cortiq_engine.kernels import jit, qdot

# The four matmuls of a layer, in plan order.
QKV, O, GATE_UP, DOWN = range(4)


@dataclass(frozen=True, eq=False)
class FusedStack:
    """One stack's arrays for ``fused_step`` (L layers, the four matmuls of each)."""

    # Per kernel call p of matmul j of layer l ([L, 4, P, ...]; a matmul over matrices of
    # two dtypes is two calls, P the most of any matmul):
    fn: np.ndarray  # int64 [L, 4, P]: the integer kernel's address
    addrs: np.ndarray  # int64 [L, 4, P, FUSE_MAX, NPARTS]: each fused matrix's part addresses
    rows: np.ndarray  # int64 [L, 4, P, FUSE_MAX]
    count: np.ndarray  # int64 [L, 4, P]: matrices fused in the call
    offs: np.ndarray  # int64 [L, 4, P, FUSE_MAX + 1]: their first output columns
    qmax: np.ndarray  # int64 [L, 4, P]: the activations' largest integer
    zmm: np.ndarray  # bool [L, 4, P]: the kernel reads interleaved rows
    bits: np.ndarray  # int64 [L, 4, P]: activation width, 8 or 16
    pwidths: np.ndarray  # int64 [L, 4, P]: the call's output columns
    nplans: np.ndarray  # int64 [L, 4]: the matmul's calls
    widths: np.ndarray  # int64 [L, 4]: the matmul's output columns
    norms: np.ndarray  # f32 [L, 2 or 4, hidden]: a pre-norm block's two norms, a sandwich block's four
    eps: np.ndarray  # f32 [L, 2 or 4]
    qk_norms: np.ndarray  # f32 [L, 2, head size] per-head q and k norms, or [L, 0, 0]: none
    qk_eps: np.ndarray  # f32 [L]
    gelu: bool  # the MLP's activation: tanh GELU, else SiLU
    windows: np.ndarray  # int64 [L]: sliding window (0: none)
    rope_of: np.ndarray  # int64 [L]: the layer's index in ``ropes``
    ropes: tuple  # the distinct layers.RoPE of the stack
    heads: tuple[int, int, int]  # query heads, KV heads, head size
    scale: float
    fns: np.ndarray  # int64: the attention's IR loops (attn_ir), or zeros
    keep: tuple  # the plans whose arrays ``addrs`` points into


_P8, _P16 = np.empty(0, np.int8), np.empty(0, np.int16)


@intrinsic
def _f16_bits(typingctx, x):
    """An f32 rounded to f16 (to nearest, ties to even: F16C's vcvtps2ph, numpy's
    ``astype(np.float16)``), as its 16 bits."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


def _put_row(dst, src):  # pragma: no cover - typed by the overload below
    """dst[:] = src into a cache row; returns the largest |value| an f16 row receives."""
    raise NotImplementedError


@overload(_put_row)
def _put_row_typed(dst, src):
    """An f32 row takes the values as they are (0.0 returned: f32 holds any value); an
    f16 cache's row (its uint16 bits: numba has no f16 arrays) takes them rounded, and
    the largest magnitude comes back for the range check ``KVCache.check_room`` makes."""
    if dst.dtype == types.uint16:

        def put_f16(dst, src):
            peak = np.float32(0.0)
            for e in range(src.shape[0]):
                v = src[e]
                peak = max(peak, abs(v))
                dst[e] = _f16_bits(v)
            return peak

        return put_f16

    def put_f32(dst, src):
        dst[:] = src
        return np.float32(0.0)

    return put_f32


@njit(inline="always")
def _plan(f, layer, j, p, X, out):  # pragma: no cover - compiled
    a = (f[0][layer, j, p], f[1][layer, j, p], f[2][layer, j, p], f[3][layer, j, p], f[4][layer, j, p])
    if f[7][layer, j, p] == 8:
        qdot.intdot(a[0], a[1], a[2], a[3], a[4], X, _P8, f[5][layer, j, p], f[6][layer, j, p], out)
    else:
        qdot.intdot(a[0], a[1], a[2], a[3], a[4], X, _P16, f[5][layer, j, p], f[6][layer, j, p], out)


@njit(inline="always")
def _matmul(f, layer, j, X, out):  # pragma: no cover - compiled
    """Matmul j of the layer: its kernel calls (one per run of matrices of one dtype, as
    ``NumbaKernels.matmul`` makes them), each into its columns of ``out``."""
    if f[9][layer, j] == 1:
        _plan(f, layer, j, 0, X, out)
        return
    c0 = 0
    for p in range(f[9][layer, j]):
        w = f[10][layer, j, p]
        tgt = np.empty((X.shape[0], w), np.float32)
        _plan(f, layer, j, p, X, tgt)
        out[:, c0 : c0 + w] = tgt
        c0 += w


@njit(inline="always")
def _attention(
    f, layer, h, nh, nkv, hd, qk_norms, qk_eps, cos, sin, kc, vc, start, window, scale, fns
):  # pragma: no cover - compiled
    """``layers.Attention`` of the normed rows ``h``: q|k|v, the per-head q/k norms where
    ``qk_norms`` has rows, RoPE, the new rows into the cache, attention, o; and the
    largest |key or value| an f16 cache received (0 for an f32 one)."""
    n = h.shape[0]
    nq, nk = nh * hd, nkv * hd
    qkv = np.empty((n, f[8][layer, QKV]), np.float32)
    _matmul(f, layer, QKV, h, qkv)
    q = np.ascontiguousarray(qkv[:, :nq]).reshape(n, nh, hd)
    k = np.ascontiguousarray(qkv[:, nq : nq + nk]).reshape(n, nkv, hd)
    if qk_norms.shape[1]:
        qn = np.empty((n * nh, hd), np.float32)
        jit.rms_norm(q.reshape(n * nh, hd), qk_norms[layer, 0], qk_eps[layer], qn)
        q = qn.reshape(n, nh, hd)
        kn = np.empty((n * nkv, hd), np.float32)
        jit.rms_norm(k.reshape(n * nkv, hd), qk_norms[layer, 1], qk_eps[layer], kn)
        k = kn.reshape(n, nkv, hd)
    jit.rope(q, cos, sin)
    jit.rope(k, cos, sin)
    peak = np.float32(0.0)
    for i in range(n):
        for g in range(nkv):
            peak = max(peak, _put_row(kc[g, start + i], k[i, g]))
            peak = max(peak, _put_row(vc[g, start + i], qkv[i, nq + nk + g * hd : nq + nk + (g + 1) * hd]))
    o = np.empty((n, nh, hd), np.float32)
    jit.attend(q, kc, vc, start, window, scale, None, o, fns)
    a = np.empty((n, f[8][layer, O]), np.float32)
    _matmul(f, layer, O, o.reshape(n, nq), a)
    return a, peak


@njit(cache=True)
def fused_step(
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
    nplans,
    pwidths,
    norms,
    eps,
    qk_norms,
    qk_eps,
    gelu,
    windows,
    rope_of,
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
    keys and values go to rows start..start+n-1 of each layer's cache (keys[l], values[l]).
    ``norms`` [L, 2, hidden]: pre-norm blocks (attention and MLP norms); [L, 4, hidden]:
    sandwich blocks (pre- and post-attention, pre- and post-MLP). ``cos``/``sin`` hold one
    table per RoPE, ``rope_of`` picks a layer's. An f16 cache comes as its uint16 bits;
    returns the largest |key or value| it received (0 for f32 caches): above f16's range
    the step is refused, its rows unclaimed (``run``)."""
    n = x.shape[0]
    peak = np.float32(0.0)
    f = (fn, addrs, rows, count, offs, qmax, zmm, bits, widths, nplans, pwidths)
    sandwich = norms.shape[1] == 4
    h = np.empty_like(x)
    for layer in range(norms.shape[0]):
        r = rope_of[layer]
        jit.rms_norm(x, norms[layer, 0], eps[layer, 0], h)
        a, p = _attention(
            f,
            layer,
            h,
            nh,
            nkv,
            hd,
            qk_norms,
            qk_eps,
            cos[r],
            sin[r],
            keys[layer],
            values[layer],
            start,
            windows[layer],
            scale,
            fns,
        )
        peak = max(peak, p)
        if sandwich:
            t = np.empty_like(a)
            jit.rms_norm(a, norms[layer, 1], eps[layer, 1], t)
            x += t
            jit.rms_norm(x, norms[layer, 2], eps[layer, 2], h)
        else:
            jit.add_rms_norm(x, a, norms[layer, 1], eps[layer, 1], h)
        gu = np.empty((n, widths[layer, GATE_UP]), np.float32)
        _matmul(f, layer, GATE_UP, h, gu)
        act = np.empty((n, widths[layer, GATE_UP] // 2), np.float32)
        if gelu:
            jit.glu_small(gu, act, True)
        else:
            jit.silu_mul(gu, act)
        d = np.empty((n, widths[layer, DOWN]), np.float32)
        _matmul(f, layer, DOWN, act, d)
        if sandwich:
            t = np.empty_like(d)
            jit.rms_norm(d, norms[layer, 3], eps[layer, 3], t)
            x += t
        else:
            x += d
    return peak


def _bits(a: np.ndarray) -> np.ndarray:
    """A cache array as ``fused_step`` reads it: f16 as its uint16 bits."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def run(stack: FusedStack, x: np.ndarray, caches, start: int, tables) -> float:
    """``fused_step`` over ``caches`` (one ``KVCache`` per layer, f32 or f16, each ``start``
    rows long); ``tables``: the (cos, sin) of each of ``stack.ropes`` at the new rows'
    positions. Returns the largest |key or value| an f16 cache received (0 for f32)."""
    s = stack
    nh, nkv, hd = s.heads
    return fused_step(
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
        s.nplans,
        s.pwidths,
        s.norms,
        s.eps,
        s.qk_norms,
        s.qk_eps,
        s.gelu,
        s.windows,
        s.rope_of,
        nh,
        nkv,
        hd,
        np.float32(s.scale),
        np.stack([c for c, _ in tables]),
        np.stack([t for _, t in tables]),
        s.fns,
        tuple(_bits(c.keys) for c in caches),
        tuple(_bits(c.values) for c in caches),
        start,
    )
