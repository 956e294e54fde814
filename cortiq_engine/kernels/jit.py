"""Compiled (numba) kernels for the hot loops. Numbers only: no weights, no models.

Every kernel writes into an ``out`` array the caller owns, takes C-contiguous
arrays, and is compiled with ``cache=True`` so a second process loads machine
code instead of recompiling. Half-precision values arrive as ``uint16`` bit
patterns (numba has no float16 on the CPU); two LLVM intrinsics widen them.

Quantized layouts are the planar ones of ``formats.quants`` (blocks of 32):
q8 ``d`` f16[rows, nb] + ``qs`` i8[rows, cols]; q4 ``d``, ``m`` f16[rows, nb] +
``qs`` u8[rows, cols/2] (byte j of a block: element j low nibble, j+16 high); q5_1 as
q4 plus a u32 ``qh`` of fifth bits, q5 as q5_1 with the min derived (-16 d). The K-quant kernels live in
``kquant_jit.py``; ``dtype_ops.py`` maps each dtype to its kernels.

The "small-batch" matmuls read each weight row once for all ``n`` input rows,
accumulating into 32 lanes across blocks so LLVM vectorizes the loop (a scalar
accumulator per block measured about 5x slower). Decode is memory-bound: the
kernels read int8/uint8 quants and f16 scales straight from the map, no copies.
"""

from __future__ import annotations

import types as pytypes

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from cortiq_engine.kernels import attn_ir, interrupts
from cortiq_engine.threads import prefer_short_spin

# Before any parallel kernel starts the OpenMP pool: idle workers spin briefly, then
# sleep (see threads.py).
prefer_short_spin()
# A Ctrl-C during a compile is delivered after it, not lost in LLVM's callbacks.
interrupts.hold_during_numba_compiles()

QB = 32  # quantization block (formats.quants.QBLOCK)


def _widening(convert):
    """A numba intrinsic float32(uint16 bits) whose code ``convert(builder, bits)`` emits."""

    def typer(typingctx, bits):
        return types.float32(types.uint16), lambda context, builder, signature, args: convert(builder, args[0])

    typer.__name__ = typer.__qualname__ = convert.__name__
    typer.__doc__ = convert.__doc__
    return intrinsic(typer)


@_widening
def f16_to_f32(builder, bits):
    """IEEE half (as uint16 bits) -> float32; compiles to vcvtph2ps with F16C."""
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


@_widening
def bf16_to_f32(builder, bits):
    """bfloat16 (as uint16 bits) -> float32: the bits are the upper half of an f32."""
    wide = builder.shl(builder.zext(bits, ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
    return builder.bitcast(wide, ir.FloatType())


@intrinsic
def prefetch(typingctx, arr, index):
    """Hint the CPU to fetch the cache line holding element ``index`` (flat) of ``arr``."""
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        try:
            fn = builder.module.get_global("llvm.prefetch.p0i8")
        except KeyError:
            fn = ir.Function(builder.module, fnty, name="llvm.prefetch.p0i8")
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        # read, high temporal locality, data cache
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


# Rows ahead of the one being multiplied whose cache lines are requested up front.
# Decode streams the weights from DRAM; the CPU's own prefetcher stops at every 4 KB
# page and fetches a row's lines one after another, so asking for a whole row a few
# rows early keeps many misses in flight: the q8 matvec went from 9.6 to 20-25 GB/s
# on 2 threads (streaming 115 MB, 8 rows ahead).
PREFETCH_ROWS = 8


@njit(inline="always")
def prefetch_row(a, r):
    if r < a.shape[0]:
        base = r * a.shape[1]
        for c in range(0, a.shape[1], 64 // a.itemsize):
            prefetch(a, base + c)


# ------------------------------------------------------------ small-batch matmul
# out[i, offs[m] + r] = sum_c W_m[r, c] * X[i, c] for the first ``count`` matrices of
# the tuples: fused projections (q|k|v, gate|up) in one call. Callers always pass
# 3-tuples (padded with empty arrays) so each kernel compiles, and loads, once: every
# specialization costs several MB of resident machine code. Each weight row is loaded once
# and stays in L1 while the n input rows pass over it; one 32-lane accumulator
# per (row, input) keeps the block loop vectorized.


def specialise(template, name: str, source: str, **consts):
    """A copy of the plain function ``template`` named ``name``, its globals extended by
    ``consts``, for ``njit`` to compile and cache as a kernel of its own. Numba inlines the
    helpers ``consts`` names; passed as arguments instead, they would miss the on-disk
    cache in every process (a dispatcher's type is new in each). ``source``, the
    specialising module's file, holds those helpers: numba recompiles the copy when it
    changes."""
    code = template.__code__.replace(co_name=name, co_qualname=name, co_filename=source)
    fn = pytypes.FunctionType(code, {**template.__globals__, **consts}, name)
    fn.__qualname__ = name
    return fn


# The kernel parts a small-batch kernel takes, in ``DType.kernel_parts`` order, the
# unused ones empty (qdot.py's integer kernels take the same five).
NPARTS = 5


def _matmul_small(p0, p1, p2, p3, p4, flag, count, offs, X, xsum, out):
    """The template of every dtype's small-batch matmul (``matmul_small``):
    ROW_DOT(parts of matrix m, flag, r, X, xsum, i) is the dot of weight row r with input
    row i; part LEAD, the largest, is prefetched ahead. ``flag``: a runtime switch of the
    row dot (q5: whether the min is stored, so Q5_0 and Q5_1 share one kernel); ``xsum``:
    X's sums over groups of 32 where the dtype has a min term (it factors out of the dot),
    else unread."""
    n = X.shape[0]
    for m in range(count):
        a0, a1, a2, a3, a4 = p0[m], p1[m], p2[m], p3[m], p4[m]
        lead = (a0, a1, a2, a3, a4)[LEAD]  # noqa: F821 - bound by specialise
        base = offs[m]
        for r in prange(lead.shape[0]):
            prefetch_row(lead, r + PREFETCH_ROWS)
            for i in range(n):
                out[i, base + r] = ROW_DOT(a0, a1, a2, a3, a4, flag, r, X, xsum, i)  # noqa: F821 - bound by specialise


def matmul_small(name: str, source: str, row_dot, lead: int):
    """The small-batch matmul kernel ``name`` of a block dtype: ``_matmul_small`` with its
    row dot ``row_dot`` (an inline helper of ``source``) and its largest part ``lead``."""
    fn = specialise(_matmul_small, name, source, ROW_DOT=row_dot, LEAD=lead)
    return njit(parallel=True, fastmath=True, cache=True)(fn)


def _scaled_dequant(d, q, r0, r1, out):
    """The template of the dequantization of blocks of 32 with one scale and no min (q8,
    q4_0): value = d * v, PAIR(q, r, b, j) the block's v of elements j and j + 16."""
    half = QB // 2
    for r in range(r0, r1):
        for b in range(d.shape[1]):
            sc = f16_to_f32(d[r, b])
            o = QB * b
            for j in range(half):
                v0, v1 = PAIR(q, r, b, j)  # noqa: F821 - bound by specialise
                out[r - r0, o + j] = sc * v0
                out[r - r0, o + j + half] = sc * v1


def _scaled_dot(d, q, _2, _3, _4, _flag, r, X, xsum, i):
    """The template of the row dots of ``_scaled_dequant``'s layout."""
    half = QB // 2
    acc = np.zeros(QB, np.float32)
    for b in range(d.shape[1]):
        sc = f16_to_f32(d[r, b])
        o = QB * b
        for j in range(half):
            v0, v1 = PAIR(q, r, b, j)  # noqa: F821 - bound by specialise
            acc[j] += sc * (v0 * X[i, o + j])
            acc[j + half] += sc * (v1 * X[i, o + j + half])
    return acc.sum()


def scaled_kernels(dtype: str, source: str, pair):
    """The dequantization kernel and the small-batch matmul of a dtype of
    ``_scaled_dequant``'s layout, from its inline helper ``pair`` (in ``source``)."""
    dequant = specialise(_scaled_dequant, f"{dtype}_dequant", source, PAIR=pair)
    row_dot = njit(inline="always")(specialise(_scaled_dot, f"_{dtype}_dot", source, PAIR=pair))
    return njit(parallel=False, nogil=True, cache=True)(dequant), matmul_small(
        f"{dtype}_matmul_small", source, row_dot, 1
    )


@njit(inline="always")
def _q8_pair(q, r, b, j):
    o = QB * b + j
    return np.float32(q[r, o]), np.float32(q[r, o + QB // 2])


@njit(inline="always")
def _q4_dot(d, mn, q, _3, _4, _flag, r, X, xsum, i):
    """Q4_1: value = d * q + min; the min term factors out of the dot."""
    half = QB // 2
    acc = np.zeros(QB, np.float32)
    macc = np.float32(0.0)
    for b in range(X.shape[1] // QB):
        sc = f16_to_f32(d[r, b])
        o = b * QB
        ob = b * half
        for j in range(half):
            byte = q[r, ob + j]
            acc[j] += sc * (np.float32(byte & 15) * X[i, o + j])
            acc[j + half] += sc * (np.float32(byte >> 4) * X[i, o + j + half])
        macc += f16_to_f32(mn[r, b]) * xsum[i, b]
    return acc.sum() + macc


@njit(inline="always")
def _q5_dot(d, mn, qh, q, _4, stored_min, r, X, xsum, i):
    """Q5_0 and Q5_1: value = d * q + min, q = nibble | (bit of qh) << 4; the min is
    stored (Q5_1, ``stored_min``) or -16 d (Q5_0: value = d * (q - 16))."""
    half = QB // 2
    acc = np.zeros(QB, np.float32)
    macc = np.float32(0.0)
    for b in range(X.shape[1] // QB):
        sc = f16_to_f32(d[r, b])
        h = qh[r, b]
        o = b * QB
        ob = b * half
        for j in range(half):
            byte = np.int32(q[r, ob + j])
            v0 = np.float32((byte & 15) | (np.int32((h >> j) & 1) << 4))
            v1 = np.float32((byte >> 4) | (np.int32((h >> (j + half)) & 1) << 4))
            acc[j] += sc * (v0 * X[i, o + j])
            acc[j + half] += sc * (v1 * X[i, o + j + half])
        lo = f16_to_f32(mn[r, b]) if stored_min else np.float32(-16.0) * sc
        macc += lo * xsum[i, b]
    return acc.sum() + macc


q8_dequant, q8_matmul_small = scaled_kernels("q8", __file__, _q8_pair)
q4_matmul_small = matmul_small("q4_matmul_small", __file__, _q4_dot, lead=2)
q5_matmul_small = matmul_small("q5_matmul_small", __file__, _q5_dot, lead=3)


def _dense_dot(w, _1, _2, _3, _4, _flag, r, X, xsum, i):
    """The template of the unquantized dtypes' row dots: WIDEN turns a stored value
    into f32; any width."""
    cols = X.shape[1]
    full = cols // QB * QB
    acc = np.zeros(QB, np.float32)
    for o in range(0, full, QB):
        for j in range(QB):
            acc[j] += WIDEN(w[r, o + j]) * X[i, o + j]  # noqa: F821 - bound by specialise
    tail = np.float32(0.0)
    for c in range(full, cols):
        tail += WIDEN(w[r, c]) * X[i, c]  # noqa: F821 - bound by specialise
    return acc.sum() + tail


@njit(inline="always")
def _as_f32(v):
    return v


def _dense_matmul_small(name: str, widen):
    row_dot = njit(inline="always")(specialise(_dense_dot, f"_{name}_dot", __file__, WIDEN=widen))
    return matmul_small(f"{name}_matmul_small", __file__, row_dot, lead=0)


# f32 weights: decode stays inside numba's thread pool (alternating BLAS calls with
# numba's parallel kernels makes the two pools fight over the cores). f16 and bf16
# weights arrive as their uint16 bits.
f32_matmul_small = _dense_matmul_small("f32", _as_f32)
f16_matmul_small = _dense_matmul_small("f16", f16_to_f32)
bf16_matmul_small = _dense_matmul_small("bf16", bf16_to_f32)


# ------------------------------------------------------------ dequantize row tiles
# For large batches: rows r0..r1 of a matrix -> f32 ``out[:r1-r0]``, then BLAS.
# Serial and without the GIL: the prefill pool (fast.py) runs one per thread on
# different row slices.


@njit(inline="always")
def _nibble_dequant(d, mn, stored_min, qh, fifth, q, r0, r1, out):
    """Q4_1 and Q5_0 / Q5_1 rows (see ``_q4_dot``, ``_q5_dot``): the min stored or -16 d,
    a fifth bit per value from ``qh`` where ``fifth``."""
    half = QB // 2
    for r in range(r0, r1):
        for b in range(d.shape[1]):
            sc = f16_to_f32(d[r, b])
            lo = f16_to_f32(mn[r, b]) if stored_min else np.float32(-16.0) * sc
            o = b * QB
            for j in range(half):
                byte = np.int32(q[r, b * half + j])
                v0, v1 = byte & 15, byte >> 4
                if fifth:
                    h = qh[r, b]
                    v0 |= np.int32((h >> j) & 1) << 4
                    v1 |= np.int32((h >> (j + half)) & 1) << 4
                out[r - r0, o + j] = sc * np.float32(v0) + lo
                out[r - r0, o + j + half] = sc * np.float32(v1) + lo


@njit(parallel=False, nogil=True, cache=True)
def q4_dequant(d, mn, q, r0, r1, out):
    _nibble_dequant(d, mn, True, q, False, q, r0, r1, out)


@njit(parallel=False, nogil=True, cache=True)
def q5_dequant(d, mn, stored_min, qh, q, r0, r1, out):
    _nibble_dequant(d, mn, stored_min, qh, True, q, r0, r1, out)


@njit(parallel=False, nogil=True, cache=True)
def half_dequant(w, bf16, r0, r1, out):
    cols = w.shape[1]
    for r in range(r0, r1):
        if bf16:
            for c in range(cols):
                out[r - r0, c] = bf16_to_f32(w[r, c])
        else:
            for c in range(cols):
                out[r - r0, c] = f16_to_f32(w[r, c])


# ------------------------------------------------------------ elementwise / norms
# error_model="numpy" on the norms: a non-finite row (weights kept with
# --allow-nonfinite, an overflow) gives NaN rows, not a ZeroDivisionError; the sampler
# then refuses the logits in one line.


@njit(fastmath=True, cache=True, error_model="numpy")
def rms_norm(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, rows of a 2-D array."""
    n, h = x.shape
    for i in range(n):
        ss = np.float32(0.0)
        for c in range(h):
            ss += x[i, c] * x[i, c]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        for c in range(h):
            out[i, c] = w[c] * (x[i, c] * inv)


@njit(fastmath=True, cache=True, error_model="numpy")
def add_rms_norm(x, delta, w, eps, out):
    """x += delta (the residual stream, in place), then out = rms_norm(x) * w."""
    n, h = x.shape
    for i in range(n):
        ss = np.float32(0.0)
        for c in range(h):
            v = x[i, c] + delta[i, c]
            x[i, c] = v
            ss += v * v
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        for c in range(h):
            out[i, c] = w[c] * (x[i, c] * inv)


@njit(fastmath=True, cache=True)
def silu_mul(gu, out):
    """gu = [gate | up] per row -> silu(gate) * up."""
    n, two = gu.shape
    k = two // 2
    for i in range(n):
        for c in range(k):
            g = gu[i, c]
            out[i, c] = g / (np.float32(1.0) + np.exp(-g)) * gu[i, k + c]


@njit(fastmath=True, cache=True)
def rope(x, cos, sin):
    """Rotate the first 2*len(cos[0]) dims of every head, HF's rotate_half layout.

    x: [n, heads, head_dim] in place; cos/sin: [n, rotary_dim/2].
    """
    n, heads, _ = x.shape
    half = cos.shape[1]
    for i in range(n):
        for h in range(heads):
            for j in range(half):
                a = x[i, h, j]
                b = x[i, h, j + half]
                c = cos[i, j]
                s = sin[i, j]
                x[i, h, j] = a * c - b * s
                x[i, h, j + half] = b * c + a * s


# ------------------------------------------------------------ attention over a cache


@njit(inline="always", fastmath=True)
def exp_nonpositive(x):
    """exp(x) for x <= 0 in f32 arithmetic that LLVM vectorizes (numba's np.exp is a
    scalar libm call: 4.3 vs 0.34 ns here, and a decode at 2k context spends 1.4M of
    them per token on the 1.1B shape). Cody-Waite reduction x = k ln2 + f with
    |f| <= ln2/2, a degree-7 Taylor polynomial for exp(f), 2^k from the exponent
    bits; below -87 the result is exp(-87) ~ 1.6e-38 (not 0). Within 3e-7 relative
    of float64 exp (``tests/test_engine_kernels.py``)."""
    v = max(x, np.float32(-87.0))
    k = np.floor(v * np.float32(1.4426950408889634) + np.float32(0.5))
    f = (v - k * np.float32(0.693145751953125)) - k * np.float32(1.428606765330187e-06)
    p = np.float32(1.0 / 5040.0)
    p = p * f + np.float32(1.0 / 720.0)
    p = p * f + np.float32(1.0 / 120.0)
    p = p * f + np.float32(1.0 / 24.0)
    p = p * f + np.float32(1.0 / 6.0)
    p = p * f + np.float32(0.5)
    p = p * f + np.float32(1.0)
    p = p * f + np.float32(1.0)
    return p * np.int32((np.int32(k) + np.int32(127)) << 23).view(np.float32)


@njit(inline="always", fastmath=True)
def sigmoid(z):
    """1 / (1 + exp(-z)) through ``exp_nonpositive`` of -|z| (no overflow either side)."""
    e = exp_nonpositive(-abs(z))
    return (np.float32(1.0) if z >= 0 else e) / (np.float32(1.0) + e)


@njit(inline="always", fastmath=True)
def _glu_row(gu, out, i, gelu):
    """Row i of ``glu_rows`` and ``glu_small``."""
    k = gu.shape[1] // 2
    c2 = np.float32(2.0 * np.sqrt(2.0 / np.pi))
    for j in range(k):
        g = gu[i, j]
        z = c2 * (g + np.float32(0.044715) * g * g * g) if gelu else g
        out[i, j] = g * sigmoid(z) * gu[i, k + j]


@njit(parallel=True, fastmath=True, cache=True)
def glu_rows(gu, out, gelu):
    """gu = [gate | up] per row -> act(gate) * up, rows in parallel, vectorized (a
    prefill's numpy silu spent 1.5 ms a SmolLM2 layer on libm exp): act = silu, g *
    sigmoid(g), or with ``gelu`` the tanh GELU, 0.5 g (1 + tanh(y)) = g * sigmoid(2 y),
    y = sqrt(2 / pi) (g + 0.044715 g^3)."""
    for i in prange(gu.shape[0]):
        _glu_row(gu, out, i, gelu)


@njit(fastmath=True, cache=True)
def glu_small(gu, out, gelu):
    """``glu_rows``' row body on one thread, for a decode's or a verify's few rows (no
    parallel region to wake; each row on its own, so a row's bits never depend on the
    rows beside it)."""
    for i in range(gu.shape[0]):
        _glu_row(gu, out, i, gelu)


@njit(fastmath=True, cache=True)
def exp_nonpositive_array(x, out):
    """``exp_nonpositive`` over an array (the tests' handle on it)."""
    for j in range(x.shape[0]):
        out[j] = exp_nonpositive(x[j])


# Keys per attention task. A query's keys split at multiples of ATTN_CHUNK (absolute
# cache rows), so its chunks, and the order their partial results combine in, never
# depend on how many queries share the call: row-exact. A chunk's keys and values
# (64 KB each at head_dim 64) stay in L2 while every query and head of a group uses them.
ATTN_CHUNK = 256
# Queries per attention task: a call with many rows (the engine sends prefills to
# ``attend_flash``; ``benchmarks/bench_attention.py`` times this one beside it) also splits
# by blocks of queries, so a model with one KV head still spreads over every core. Which
# task computes a query never changes its result.
ATTN_QUERIES = 32
# Partial results above this many (queries x heads x chunks) combine in parallel.
ATTN_SERIAL_COMBINE = 512


@njit(parallel=True, fastmath=True, cache=True)
def attend(q, kc, vc, start, window, scale, sinks, out, fns):
    """Causal GQA attention of n new queries over a KV cache (twin of
    ``reference.NumpyKernels.attend``).

    q: [n, heads, d]; kc: [kv_heads, cap, d]; vc: [kv_heads, cap, dv]; the new
    keys already sit at cache rows start..start+n-1. Query i sees rows
    lo..start+i, lo = start+i-window+1 for a sliding window (window > 0).
    sinks: f32 [heads] learned logits that join each softmax without a value row,
    or None (numba compiles the None case on its own, without the sink terms).
    out: [n, heads, dv]. Each query row is computed on its own, whatever n is.

    Split-K (flash decoding): one task is a chunk of ATTN_CHUNK keys of one KV head,
    for every query and every head of the KV head's group, so each key and value
    row comes from memory once per call (8 query heads share it on TinyLlama's
    shape, 3 on SmolLM2's; a verify's rows share it too), and a single decode row
    still spreads over every core. A task leaves, per query and head, its chunk's
    max, exp-sum and unnormalized output; ``_combine`` rescales and adds them in
    chunk order.

    fns: int64[3], the addresses of ``attn_ir``'s score, value and softmax loops (C-contiguous
    q, kc, vc with head dimensions in whole 16-lane chunks), or zeros: the loops here.
    An f16 cache arrives as its uint16 bits, which only the IR loops compiled for it read.
    """
    if kc.itemsize != 4 and fns[0] == 0:
        raise ValueError("an f16 cache needs the IR loops")
    n, heads, d = q.shape
    kvh = kc.shape[0]
    dv = vc.shape[2]
    group = heads // kvh
    nch = (start + n + ATTN_CHUNK - 1) // ATTN_CHUNK
    pmax = np.empty((n, heads, nch), np.float32)
    # (np.empty: np.zeros would be a parallel region of its own, a second wake-up of the pool)
    psum = np.empty((n, heads, nch), np.float32)  # 0: the query sees no key of the chunk
    pout = np.empty((n, heads, nch, dv), np.float32)
    ir_scores, ir_values, ir_softmax = fns[0], fns[1], fns[2]
    nqb = (n + ATTN_QUERIES - 1) // ATTN_QUERIES
    for t in prange(kvh * nch * nqb):
        g = t // (nch * nqb)
        c = (t // nqb) % nch
        qb = t % nqb
        h0 = g * group
        s = np.empty((group, ATTN_CHUNK), np.float32)  # the group's scores, then weights
        o = np.empty((group, dv), np.float32)
        res = np.empty(2, np.float32)  # attn_softmax's (max, sum)
        for i in range(qb * ATTN_QUERIES, min(n, (qb + 1) * ATTN_QUERIES)):
            hi = start + i + 1
            lo = 0
            if window > 0 and hi - window > 0:
                lo = hi - window
            j0 = max(lo, c * ATTN_CHUNK)
            j1 = min(hi, (c + 1) * ATTN_CHUNK)
            if j0 >= j1:
                for h in range(h0, h0 + group):
                    psum[i, h, c] = 0.0
                continue
            m = j1 - j0
            if ir_scores != 0:
                # every key row loaded once for the whole group (attn_ir.py)
                for a in range(0, group, attn_ir.MAX_GROUP):
                    attn_ir.call_scores(
                        ir_scores,
                        min(attn_ir.MAX_GROUP, group - a),
                        q.ctypes.data + 4 * ((i * heads + h0 + a) * d),
                        kc.ctypes.data + kc.itemsize * ((g * kc.shape[1] + j0) * d),
                        m,
                        d,
                        scale,
                        s.ctypes.data + 4 * a * ATTN_CHUNK,
                        ATTN_CHUNK,
                    )
            else:
                # the group's heads one after another: the chunk's rows stay in L2 between them
                for hh in range(group):
                    for j in range(j0, j1):
                        acc = np.float32(0.0)
                        for e in range(d):
                            acc += q[i, h0 + hh, e] * kc[g, j, e]
                        s[hh, j - j0] = acc * scale
            for hh in range(group):
                if ir_softmax != 0:
                    attn_ir.call_softmax(ir_softmax, s.ctypes.data + 4 * hh * ATTN_CHUNK, m, res.ctypes.data)
                    mx, tot = res[0], res[1]
                else:
                    mx = np.float32(-np.inf)
                    for j in range(m):
                        mx = max(mx, s[hh, j])
                    tot = np.float32(0.0)
                    for j in range(m):
                        ev = exp_nonpositive(s[hh, j] - mx)
                        s[hh, j] = ev
                        tot += ev
                pmax[i, h0 + hh, c] = mx
                psum[i, h0 + hh, c] = tot
            if ir_values != 0:
                for a in range(0, group, attn_ir.MAX_GROUP):
                    attn_ir.call_values(
                        ir_values,
                        min(attn_ir.MAX_GROUP, group - a),
                        s.ctypes.data + 4 * a * ATTN_CHUNK,
                        vc.ctypes.data + vc.itemsize * ((g * vc.shape[1] + j0) * dv),
                        m,
                        dv,
                        o.ctypes.data + 4 * a * dv,
                        ATTN_CHUNK,
                        dv,
                    )
            else:
                for hh in range(group):
                    for e in range(dv):
                        o[hh, e] = 0.0
                    # four value rows per pass over o: a quarter of the loads and stores of o,
                    # whose store-to-load chain bounded the one-row loop (fixed order: row-exact)
                    j = j0
                    while j + 4 <= j1:
                        p0, p1, p2, p3 = s[hh, j - j0], s[hh, j + 1 - j0], s[hh, j + 2 - j0], s[hh, j + 3 - j0]
                        for e in range(dv):
                            o[hh, e] += (p0 * vc[g, j, e] + p1 * vc[g, j + 1, e]) + (
                                p2 * vc[g, j + 2, e] + p3 * vc[g, j + 3, e]
                            )
                        j += 4
                    while j < j1:
                        p = s[hh, j - j0]
                        for e in range(dv):
                            o[hh, e] += p * vc[g, j, e]
                        j += 1
            for hh in range(group):
                for e in range(dv):
                    pout[i, h0 + hh, c, e] = o[hh, e]
    if n * heads * nch > ATTN_SERIAL_COMBINE:
        for t in prange(n * heads):
            _combine(t // heads, t % heads, pmax, psum, pout, sinks, out)
    else:  # a decode row: cheaper than starting the thread pool again
        for t in range(n * heads):
            _combine(t // heads, t % heads, pmax, psum, pout, sinks, out)


@njit(inline="always", fastmath=True)
def _combine(i, h, pmax, psum, pout, sinks, out):
    """Query i, head h: its chunks' partial softmax results rescaled to one max and added in chunk order."""
    nch = pmax.shape[2]
    dv = pout.shape[3]
    mx = np.float32(-np.inf) if sinks is None else sinks[h]  # a dominant sink cannot overflow exp
    for c in range(nch):
        if psum[i, h, c] != np.float32(0.0):
            mx = max(mx, pmax[i, h, c])
    tot = np.float32(0.0) if sinks is None else exp_nonpositive(sinks[h] - mx)
    # (np.empty and a loop: outside a prange, np.zeros would start a parallel region of its own)
    o = np.empty(dv, np.float32)
    for e in range(dv):
        o[e] = 0.0
    for c in range(nch):
        if psum[i, h, c] == np.float32(0.0):
            continue
        f = exp_nonpositive(pmax[i, h, c] - mx)
        tot += f * psum[i, h, c]
        for e in range(dv):
            o[e] += f * pout[i, h, c, e]
    inv = np.float32(1.0) / tot
    for e in range(dv):
        out[i, h, e] = o[e] * inv


# ------------------------------------------------------------ prefill attention
# Keys per block of a prefill job: the block's transposed keys and values (32 KB each at
# head_dim 64) stay in L2 while every row of the job uses them (64: 8 % slower on SmolLM2's
# shape, more rescaling per key).
FLASH_KEYS = 128
# Queries per job: with their group's heads, the rows of the job's two products (96 on
# SmolLM2's shape, 256 on TinyLlama's); 16 and 64 measured within 5 % of 32.
FLASH_QUERIES = 32
# Below any real score: a row's running maximum before its first key (an infinity would
# be undefined under fastmath).
_LOWEST = np.float32(-3.0e38)


@intrinsic
def fetch_add(typingctx, addr):
    """Atomically add 1 to the int64 at address ``addr`` and return the value before."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@njit(nogil=True, fastmath=True, cache=True)
def attend_flash(q, kt, k0, vc, start, window, scale, sinks, out, jobs, counter, fns):
    """Prefill attention (same contract as ``attend``), by blocks of queries and keys.

    kt: f32 [kv_heads, d, >= keys + 16], the keys from cache row k0 on, transposed
    (column c is row k0 + c; the caller copies them once per call). jobs: int64 [jobs,
    3] of (first query, end query, KV head); counter: int64 [1], 0 at the start, shared
    by every thread that runs this call at once: each pulls the next job until none is
    left, so a thread that another process holds off its core delays one job, not a
    fixed share of the call. fns: ``attn_ir.AttentionLoops.addrs``.

    A job's rows are its queries times its group's heads. Per block of FLASH_KEYS keys:
    scores = queries x keys (``attn_gemm``), each row's softmax over the keys it sees
    (``attn_softmax``; the others weigh 0), its running maximum, sum and weighted values
    rescaled when the maximum grows, then values += weights x value rows (``attn_gemm``).
    A row's result depends on the job's block boundaries, not on the thread that ran it:
    a call gives the same bits on any number of threads, but not its rows' one-row
    results (the verify stays on ``attend``)."""
    while True:
        t = fetch_add(counter.ctypes.data)
        if t >= jobs.shape[0]:
            return
        _flash_job(q, kt, k0, vc, start, window, scale, sinks, out, jobs[t, 0], jobs[t, 1], jobs[t, 2], fns[3], fns[2])


@njit(fastmath=True, nogil=True)
def _flash_job(q, kt, k0, vc, start, window, scale, sinks, out, i0, i1, g, gemm, softmax):
    heads, d = q.shape[1], q.shape[2]
    dv = vc.shape[2]
    group = heads // vc.shape[0]
    h0 = g * group
    rows = (i1 - i0) * group
    ldk = kt.shape[2]
    kb = FLASH_KEYS
    a = np.empty((rows, d), np.float32)  # row (i - i0) * group + hh: query i, head h0 + hh, scaled
    s = np.empty((rows, kb), np.float32)  # a key block's scores, then weights
    o = np.zeros((rows, dv), np.float32)  # weighted values, relative to the row's running max
    mx = np.empty(rows, np.float32)
    tot = np.empty(rows, np.float32)
    res = np.empty(2, np.float32)  # attn_softmax's (max, sum)
    for r in range(rows):
        i, h = i0 + r // group, h0 + r % group
        for e in range(d):
            a[r, e] = q[i, h, e] * scale
        if sinks is None:
            mx[r] = _LOWEST
            tot[r] = 0.0
        else:  # the sink joins the max and the sum, never the values
            mx[r] = sinks[h]
            tot[r] = 1.0
    hi = start + i1  # the job's last query sees keys < hi
    lo = 0
    if window > 0:
        lo = max(0, start + i0 - window + 1)  # its first sees keys >= lo
    for j0 in range(lo, hi, kb):
        m = min(kb, hi - j0)
        attn_ir.call_gemm(
            gemm,
            a.ctypes.data,
            d,
            kt.ctypes.data + 4 * (g * d * ldk + j0 - k0),
            ldk,
            s.ctypes.data,
            kb,
            rows,
            (m + 15) // 16 * 16,
            d,
            0,
        )
        for r in range(rows):
            pos = start + i0 + r // group  # the query's own cache row
            c0 = j0
            if window > 0:
                c0 = max(j0, pos - window + 1)
            c1 = min(j0 + m, pos + 1)
            if c1 <= c0:  # none of the block's keys
                for j in range(m):
                    s[r, j] = 0.0
                continue
            attn_ir.call_softmax(softmax, s.ctypes.data + 4 * (r * kb + c0 - j0), c1 - c0, res.ctypes.data)
            bmax, bsum = res[0], res[1]
            for j in range(c0 - j0):
                s[r, j] = 0.0
            for j in range(c1 - j0, m):
                s[r, j] = 0.0
            if bmax > mx[r]:  # the row's earlier values shrink to the new maximum
                f = exp_nonpositive(mx[r] - bmax)
                for e in range(dv):
                    o[r, e] *= f
                tot[r] = tot[r] * f + bsum
                mx[r] = bmax
            else:  # this block's weights shrink to the row's maximum
                f = exp_nonpositive(bmax - mx[r])
                for j in range(c0 - j0, c1 - j0):
                    s[r, j] *= f
                tot[r] += bsum * f
        attn_ir.call_gemm(
            gemm,
            s.ctypes.data,
            kb,
            vc.ctypes.data + 4 * ((g * vc.shape[1] + j0) * dv),
            dv,
            o.ctypes.data,
            dv,
            rows,
            dv,
            m,
            1,
        )
    for r in range(rows):
        i, h = i0 + r // group, h0 + r % group
        inv = np.float32(1.0) / tot[r]
        for e in range(dv):
            out[i, h, e] = o[r, e] * inv


# ------------------------------------------------------------ the gated delta rule


# Serial on purpose: the per-call work is small, and a parallel launch costs more than
# it saves on a busy 2-core machine (measured: 19 ms vs 1 ms per decode step).
@njit(cache=True)
def delta_rule(q, k, v, g, beta, S, o):  # pragma: no cover - compiled
    """Gated DeltaNet's recurrence (twin of ``reference.gated_delta_rule``), one
    position after another; ``S`` [hv, dk, dv] is updated in place, o [n, hv, dv]."""
    n = q.shape[0]
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // hk
    for h in range(hv):
        kh = h // rep
        kv = np.empty(dv, np.float32)
        for t in range(n):
            decay = np.float32(np.exp(g[t, h]))
            for i in range(dk):
                for j in range(dv):
                    S[h, i, j] *= decay
            for j in range(dv):
                kv[j] = 0.0
            for i in range(dk):
                ki = k[t, kh, i]
                for j in range(dv):
                    kv[j] += ki * S[h, i, j]
            b = beta[t, h]
            for j in range(dv):
                kv[j] = (v[t, h, j] - kv[j]) * b  # now the delta
            for i in range(dk):
                ki = k[t, kh, i]
                for j in range(dv):
                    S[h, i, j] += ki * kv[j]
            for j in range(dv):
                o[t, h, j] = 0.0
            for i in range(dk):
                qi = q[t, kh, i]
                for j in range(dv):
                    o[t, h, j] += qi * S[h, i, j]
