"""Integer dot products for quantized weights: decode and verify on integer activations.

ggml's idea (``vec_dot_type``): quantize each input row once per call to integers
in blocks of 32 (one f32 scale per block), then multiply a weight block by it in
integer SIMD, where the float kernels in ``jit.py`` convert every weight to f32
first. numba does not produce ``vpmaddubsw``/``vpmaddwd`` from Python loops
(integer dot loops measured 3-10x slower than the float kernel), so the inner loops
are written once in LLVM IR (generated below, one body per number of input rows so
the accumulators stay in registers), compiled with llvmlite for the host CPU and
called from numba's parallel loops through a function pointer. Hosts without
AVX2/FMA/F16C use the float kernels; ``qdot_ref`` is the float64 twin the tests
hold the kernels against.

Two activation widths (the default kernel set: int16 for q8, int8 for the others; the
K-quants have int8 bodies only, as ggml's):
- int16: ``vpmaddwd`` on sign-extended weights. Rounding the activations to
  1/32767 of a block's maximum leaves the logits' error where the float kernels
  have it: SmolLM2 q8 decode KL to f32 0.000960 with both, Gemma 3 q8 0.000371
  with both (``benchmarks/bench_int8_error.py``).
- int8: ggml's ``vpmaddubsw`` sign trick, faster (a 4-row q4 verify at 1.1B:
  126 vs 147 ms), but the rounding multiplies q8's KL by 4-6 (SmolLM2 0.00398,
  Gemma 3 0.00216), whose activations have large outliers inside a block. For q4 it
  is lost in the weights' own error: Gemma 3 q4 KL 0.1814 vs 0.1795.

Per weight row and input row the result is
    sum_b  d_w[b] * d_x[b] * sum_j q_w[b, j] * q_x[b, j]      (q8)
    sum_b  d_w[b] * d_x[b] * sum_j q_w[b, j] * q_x[b, j] + m_w[b] * s_x[b]   (q4: Q4_1 layout)
with s_x[b] = d_x[b] * sum_j q_x[b, j]. q5_1 (Q5_1) is q4 with a fifth bit per
quant; q4_0 and q5 (Q5_0) are q4 and q5_1 with a derived min, m_w = -8 d_w and -16 d_w. The K-quants (q4k, q5k, q6k: ggml's Q4_K, Q5_K, Q6_K
super-blocks of 256) split into 8 groups of 32 aligned with the activation blocks:
    sum_g  (d * sc_g) * d_x[g] * isum_g  -  sum_g (dmin * m_g) * s_x[g]   (q4k, q5k)
    sum_g  d * d_x[g] * sum_h sc_{g,h} * isum_{g,h}                        (q6k, two
                                                     8-bit scales per group, integer)
iq4_xs (IQ4_XS) takes the q4k body with its levels looked up (vpshufb) and ggml's sign
trick, one 6-bit scale per group and no min; iq4_nl (IQ4_NL) takes q4_0's 32-block body
with that lookup and sign trick, one f16 scale per block and no min; q3k (Q3_K) takes iq4_xs's sign trick on its
3-bit signed quants, whose sixteen 6-bit scales (unpacked as ggml does, four i32
operations per four scales) meet the 16-value sums in the integer domain: one vpmulld
per input row and half super-block.
ggml itself quantizes K-quant activations per 256 (Q8_K); per 32 costs a float
multiply per group and keeps the rounding finer. The block sums are exact integers
and the float accumulation order of one input row never depends on the others, so a
row's result in a k-row call is bit for bit its result in a 1-row call (the
speculative verify relies on this).

Where the CPU has AVX-512 VNNI, calls take 512-bit bodies (on Intel only for large
matrices: ``fast.ZMM_MIN_WEIGHTS``): q4/q4_0 1- and 2-row calls two blocks a product
(``_pbody``), q4k/q6k ones two groups a product (``_kpbody``), 3- and 4-row calls
sharing each dot product between rows (q4/q4_0: ``_zbody``, input rows side by side;
q8: ``_wbody``, weight rows side by side); all
replay the per-row bodies' float operations lane for lane: the same bits, so the
verify stays row-exact.
"""

from __future__ import annotations

import platform
import threading
from pathlib import Path
from typing import Mapping

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from cortiq_engine.kernels import llvm_jit
from cortiq_engine.kernels.dtype_ops import OPS, ops_for

QB = 32
# Input rows one IR call handles with all accumulators in registers (AVX2 has 16).
MAX_ROWS = 4
# How far ahead of the block being multiplied the weights are prefetched (the CPU's own
# prefetcher stops at pages). A fixed distance in bytes, not in rows: 8 rows ahead suits
# SmolLM2's 576-column rows (4.6 KB), but at 2,048 columns (16 KB ahead) a 1.1B q8 decode
# step took 57-61 ms where 2-3 KB ahead took 47-53 (a 4-row verify 78 vs 70-74 ms;
# Sapphire Rapids, 2 threads; SmolLM2 within noise from 2 to 16 KB).
PREFETCH_BYTES = 3072
NEEDED_FEATURES = ("avx2", "fma", "f16c")


# ------------------------------------------------------------ activations
@njit(cache=True, nogil=True)
def quantize_rows(X, xq, xd, xs, qmax):
    """X f32[n, cols] -> xq int8 (round half to even of x / d), xd = max|x| / 127,
    xs = xd * sum(xq) per block of 32."""
    n, cols = X.shape
    nb = cols // QB
    for i in range(n):
        for b in range(nb):
            o = b * QB
            amax = np.float32(0.0)
            for j in range(QB):
                a = abs(X[i, o + j])
                if a > amax:
                    amax = a
            d = amax / np.float32(qmax)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s = 0
            for j in range(QB):
                q = np.int32(np.rint(X[i, o + j] * inv))
                xq[i, o + j] = q
                s += q
            xd[i, b] = d
            xs[i, b] = d * np.float32(s)


def quantize_rows_ref(
    X: np.ndarray, bits: int = 8, top: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy twin of ``quantize_rows`` (``top``: the largest integer, default 2^(bits-1) - 1)."""
    n, cols = X.shape
    b = X.reshape(n, cols // QB, QB).astype(np.float32)
    d = np.abs(b).max(axis=2) / np.float32(top or 2 ** (bits - 1) - 1)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[:, :, None]).astype(np.int8 if bits == 8 else np.int16)
    s = (d * q.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(n, cols), d, s


def qdot_ref(dtype: str, parts: Mapping[str, np.ndarray], X: np.ndarray, bits: int = 8) -> np.ndarray:
    """float64 reference of the integer kernels: [n, rows] for X f32[n, cols] and the
    weight ``parts`` (name -> array, as stored): the same rounded activations, the
    weights decoded by their numpy twin (``formats.quants``), multiplied in float64."""
    from formats.quants import get_dtype

    xq, xd, _ = quantize_rows_ref(X, bits, qmax(dtype, bits))
    n, cols = X.shape
    xa = (xq.reshape(n, cols // QB, QB).astype(np.float64) * xd[:, :, None]).reshape(n, cols)
    dt = get_dtype(dtype)
    rows = next(iter(parts.values())).shape[0]
    W = dt.decode(dict(parts), (rows, cols)).astype(np.float64)
    return xa @ W.T


# ------------------------------------------------------------ LLVM IR
_DECLS = """
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <8 x i32> @llvm.x86.avx2.phadd.d(<8 x i32>, <8 x i32>)
declare <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32>, <8 x i32>, <8 x i32>)
declare <8 x i32> @llvm.x86.avx512.vpdpwssd.256(<8 x i32>, <8 x i32>, <8 x i32>)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fma.f32(float, float, float)
declare void @llvm.prefetch.p0i8(i8*, i32, i32, i32)
"""
# The grid bodies' table lookup (vpshufb), declared only where one is compiled.
_DECL_GRID = "declare <32 x i8> @llvm.x86.avx2.pshuf.b(<32 x i8>, <32 x i8>)"
_ONES16 = "<" + ", ".join(["i16 1"] * 16) + ">"
# The signature every dtype shares: its kernel parts (``DType.kernel_parts`` order,
# up to five, unused ones null), then the rows and the activations:
#   (nx, p0..p4, r0, r1, nb, xq, xd, xs, out, ostride)
# out[i * ostride + r] for input rows i < nx and weight rows r0 <= r < r1; nb counts
# blocks of 32 per row (a K-quant super-block is 8 of them).
NPARTS = 5
_PARGS = ", ".join(f"i8* %p{k}" for k in range(NPARTS))
# The 4-row zmm bodies (``_zbody``) also read the rows' interleaved copy: xt, xdt, xst.
_ARGS = _PARGS + (
    ", i64 %r0, i64 %r1, i64 %nb, i8* %xq, float* %xd, float* %xs, float* %out, i64 %ostride,"
    " i8* %xt, float* %xdt, float* %xst"
)
_CALL_ARGS = _ARGS
# Which kernel part each role of the 32-block bodies is, (scale, min, fifth bits,
# quants), is the dtype record's ``roles`` (dtype_ops.py). q8 has no min term; q4_0
# and q5 (Q5_0) are symmetric: d * (q - z) = d * q + (-z * d), a min derived from the
# scale (exact in f32, the record's ``zero``), so they take the nibble body with that min.


def _nibbles(kind: str) -> bool:
    """Packed 4-bit quants (16 bytes a block)."""
    return ops_for(kind).nibbles


def _grid(kind: str) -> bool:
    """4-bit indices into signed levels (IQ4_NL's, IQ4_XS's): a table lookup, no min."""
    return bool(ops_for(kind).kgrid)


def _min_term(kind: str) -> bool:
    """A 32-block body's min term: the unsigned nibbles (stored min or zero point)."""
    return _nibbles(kind) and not _grid(kind)


def _levels(f: "_Fn", kind: str, idx: str) -> str:
    """The grid's signed levels of the <32 x i8> 4-bit indices ``idx`` (vpshufb: the
    16-entry table repeated in both 128-bit lanes)."""
    table = "<" + ", ".join(f"i8 {v}" for v in list(ops_for(kind).kgrid) * 2) + ">"
    return f.v(f"call <32 x i8> @llvm.x86.avx2.pshuf.b(<32 x i8> {table}, <32 x i8> {idx})")


def _stored_min(kind: str) -> bool:
    return ops_for(kind).roles[1] is not None


# Integer widths each dtype's kernels exist for (the records' ``int_widths``).
WIDTHS = {d: o.int_widths for d, o in OPS.items() if o.int_widths}


def qmax(kind: str, act: int) -> int:
    """The largest activation integer of ``kind``'s kernels on ``act``-bit activations."""
    return ops_for(kind).qmax(act)


KQUANTS = tuple(d for d, o in OPS.items() if o.kbody)


def _entry(kind: str, act: int) -> str:
    """The IR name of ``kind``'s kernels on ``act``-bit activations (q8, q8a16, ...)."""
    return kind if act == 8 else f"{kind}a16"


class _Fn:
    """A tiny SSA writer: fresh value names and the lines of one function; ``vnni``:
    the integer dot products use vpdpbusd / vpdpwssd (AVX512-VNNI or AVX-VNNI)."""

    def __init__(self, vnni: bool = False) -> None:
        self.lines: list[str] = []
        self.n = 0
        self.vnni = vnni

    def __call__(self, text: str) -> None:
        self.lines.append(text)

    def v(self, expr: str) -> str:
        self.n += 1
        name = f"%t{self.n}"
        self.lines.append(f"  {name} = {expr}")
        return name


def _half(f: _Fn, base: str, index: str) -> str:
    """An f16 element (stored as i16) widened to float: vcvtph2ps."""
    p = f.v(f"getelementptr i16, i16* {base}, i64 {index}")
    h = f.v(f"load half, half* {f.v(f'bitcast i16* {p} to half*')}, align 2")
    return f.v(f"fpext half {h} to float")


def _wunpack(f: _Fn, kind: str, act: int, b: str, prefetch: bool = True) -> tuple[str, ...]:
    """Weight block ``b`` of the current row as the integer operand(s) of ``_isum``:
    act 8: (w <32 x i8>, |w| for q8); act 16: (w0, w1 <16 x i16>)."""
    q4 = _nibbles(kind)
    wbytes = 16 if q4 else 32
    bw = f.v(f"mul i64 {b}, {wbytes}")
    wo = f.v(f"add i64 %wqrow, {bw}")
    wp = f.v(f"getelementptr i8, i8* %wq, i64 {wo}")
    if prefetch:
        pfp = f.v(f"getelementptr i8, i8* {wp}, i64 %pf_ahead")
        f(f"  call void @llvm.prefetch.p0i8(i8* {pfp}, i32 0, i32 3, i32 1)")
    if q4 and _grid(kind):  # signed levels: then as q8's signed bytes
        w = _levels(f, kind, _unpack_nibbles(f, wp))
        if act == 8:
            return w, f.v(f"call <32 x i8> @llvm.abs.v32i8(<32 x i8> {w}, i1 false)")
        lo, hi = _slice(f, "i8", 32, w, range(16)), _slice(f, "i8", 32, w, range(16, 32))
        return f.v(f"sext <16 x i8> {lo} to <16 x i16>"), f.v(f"sext <16 x i8> {hi} to <16 x i16>")
    if q4:
        w = _unpack_nibbles(f, wp)
        if ops_for(kind).roles[2] is not None:  # the fifth bits: bit j of the block's u32 -> element j
            hp = f.v(f"getelementptr i32, i32* %wh, i64 {f.v(f'add i64 %wdrow, {b}')}")
            bits = f.v(f"bitcast i32 {f.v(f'load i32, i32* {hp}, align 4')} to <32 x i1>")
            hb = f.v(
                f"shl <32 x i8> {f.v(f'zext <32 x i1> {bits} to <32 x i8>')}, " + "<" + ", ".join(["i8 4"] * 32) + ">"
            )
            w = f.v(f"or <32 x i8> {w}, {hb}")
        if act == 8:
            return (w,)
        lo, hi = _slice(f, "i8", 32, w, range(16)), _slice(f, "i8", 32, w, range(16, 32))
        return f.v(f"zext <16 x i8> {lo} to <16 x i16>"), f.v(f"zext <16 x i8> {hi} to <16 x i16>")
    if act == 8:
        w = f.v(f"load <32 x i8>, <32 x i8>* {f.v(f'bitcast i8* {wp} to <32 x i8>*')}, align 1")
        # maddubs takes one unsigned operand: |w|, and x carries w's sign (ggml's trick).
        return w, f.v(f"call <32 x i8> @llvm.abs.v32i8(<32 x i8> {w}, i1 false)")
    wp1 = f.v(f"getelementptr i8, i8* {wp}, i64 16")
    l0 = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp} to <16 x i8>*')}, align 1")
    l1 = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp1} to <16 x i8>*')}, align 1")
    return f.v(f"sext <16 x i8> {l0} to <16 x i16>"), f.v(f"sext <16 x i8> {l1} to <16 x i16>")


def _isum(f: _Fn, kind: str, act: int, wv: tuple[str, ...], r: int, b: str) -> str:
    """The exact integer products of weight block ``wv`` and block ``b`` of input row
    ``r``, as <8 x i32> partial sums (their total is the block's dot product)."""
    xo = f.v(f"add i64 {f.v(f'mul i64 %cols, {r}')}, {f.v(f'mul i64 {b}, 32')}")
    if act == 8:
        x = f.v(
            f"load <32 x i8>, <32 x i8>* {f.v('bitcast i8* ' + f.v(f'getelementptr i8, i8* %xq, i64 {xo}') + ' to <32 x i8>*')}, align 1"
        )
        if not _min_term(kind):  # signed quants (q8, the grids): ggml's sign trick
            u, v = wv[1], f.v(f"call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {x}, <32 x i8> {wv[0]})")
        else:
            u, v = wv[0], x
        return _dot_u8s8(f, u, v)
    xp = f.v(f"getelementptr i16, i16* %xq16, i64 {xo}")
    xp1 = f.v(f"getelementptr i16, i16* {xp}, i64 16")
    x0 = f.v(f"load <16 x i16>, <16 x i16>* {f.v(f'bitcast i16* {xp} to <16 x i16>*')}, align 2")
    x1 = f.v(f"load <16 x i16>, <16 x i16>* {f.v(f'bitcast i16* {xp1} to <16 x i16>*')}, align 2")
    return _dot_i16(f, wv[0], x0, wv[1], x1)


def _dot_i16(f: _Fn, w0: str, x0: str, w1: str, x1: str) -> str:
    """w0 . x0 + w1 . x1 on <16 x i16>, pair sums per i32 lane: two chained vpdpwssd
    with VNNI, else two vpmaddwd and an add (the same integers)."""
    if f.vnni:
        c = [f.v(f"bitcast <16 x i16> {t} to <8 x i32>") for t in (w0, x0, w1, x1)]
        p0 = f.v(
            f"call <8 x i32> @llvm.x86.avx512.vpdpwssd.256(<8 x i32> zeroinitializer, <8 x i32> {c[0]}, <8 x i32> {c[1]})"
        )
        return f.v(f"call <8 x i32> @llvm.x86.avx512.vpdpwssd.256(<8 x i32> {p0}, <8 x i32> {c[2]}, <8 x i32> {c[3]})")
    p0 = f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {w0}, <16 x i16> {x0})")
    p1 = f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {w1}, <16 x i16> {x1})")
    return f.v(f"add <8 x i32> {p0}, {p1}")


def _dot_u8s8(f: _Fn, u: str, v: str) -> str:
    """Unsigned bytes ``u`` times signed bytes ``v``, four adjacent products per i32
    lane: one vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd (the same integers: no
    pair here reaches vpmaddubsw's i16 saturation, |u| <= 128 and |v| <= 127)."""
    if f.vnni:
        a, b = f.v(f"bitcast <32 x i8> {u} to <8 x i32>"), f.v(f"bitcast <32 x i8> {v} to <8 x i32>")
        return f.v(
            f"call <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32> zeroinitializer, <8 x i32> {a}, <8 x i32> {b})"
        )
    p16 = f.v(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {u}, <32 x i8> {v})")
    return f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p16}, <16 x i16> {_ONES16})")


def _block(
    f: _Fn, kind: str, act: int, nx: int, b: str, accs: list[str], maccs: list[str]
) -> tuple[list[str], list[str]]:
    """Multiply weight block ``b`` of the current row by block ``b`` of each input row
    and add it into ``accs[r]`` (and the q4 min term into ``maccs[r]``); the new names."""
    q4 = _min_term(kind)
    wv = _wunpack(f, kind, act, b)
    wdo = f.v(f"add i64 %wdrow, {b}")
    dw = _half(f, "%wd", wdo)
    if _stored_min(kind):
        mw = _half(f, "%wm", wdo)
    elif q4:  # q4_0, q5: d * (q - z) = d * q + (-z * d), exact in f32
        mw = f.v(f"fmul float {dw}, -{ops_for(kind).zero}.0")
    new_accs, new_maccs = [], []
    for r in range(nx):
        p32 = _isum(f, kind, act, wv, r, b)
        pf = f.v(f"sitofp <8 x i32> {p32} to <8 x float>")
        xdo = f.v(f"add i64 {f.v(f'mul i64 %nb, {r}')}, {b}")
        dx = _load_at(f, "float", "float", "%xd", xdo)
        sc = f.v(f"fmul float {dw}, {dx}")
        sv = f.v(
            f"shufflevector <8 x float> {f.v(f'insertelement <8 x float> undef, float {sc}, i32 0')}, <8 x float> undef, <8 x i32> zeroinitializer"
        )
        new_accs.append(
            f.v(f"call <8 x float> @llvm.fma.v8f32(<8 x float> {pf}, <8 x float> {sv}, <8 x float> {accs[r]})")
        )
        if q4:
            xsv = f.v(f"load float, float* {f.v(f'getelementptr float, float* %xs, i64 {xdo}')}, align 4")
            new_maccs.append(f.v(f"call float @llvm.fma.f32(float {mw}, float {xsv}, float {maccs[r]})"))
        else:
            new_maccs.append(maccs[r])
    return new_accs, new_maccs


def _loop_back(
    f: _Fn,
    i: str,
    nxt: str,
    limit: str,
    head: str,
    entry: str,
    out: str,
    phi_at: int,
    carried: list[tuple[str, str, str, str]],
) -> None:
    """Close the counted loop whose block ``head`` was entered from ``entry`` (its
    phis go at line ``phi_at``): ``nxt`` = ``i`` + 1, back to ``head`` while below
    ``limit``, else on to ``out``; each carried (name, type, initial, next) value
    gets its phi [initial, entry], [next, head]."""
    f(f"  {nxt} = add i64 {i}, 1")
    f(f"  %{head}_more = icmp slt i64 {nxt}, {limit}")
    f(f"  br i1 %{head}_more, label %{head}, label %{out}")
    f.lines[phi_at:phi_at] = [f"  {n} = phi {t} [{v0}, %{entry}], [{v1}, %{head}]" for n, t, v0, v1 in carried]


def _carried8(accs: list[str], new: list[str], mins: tuple[list[str], list[str]] | None = None) -> list:
    """``_loop_back``'s carried values for <8 x float> accumulators (each from zero to its
    next value), then for the min accumulators where there are (``mins``: names, next)."""
    pairs = list(zip(accs, new)) + (list(zip(*mins)) if mins is not None else [])
    return [(a, "<8 x float>", "zeroinitializer", n) for a, n in pairs]


def _close_rows(f: _Fn) -> str:
    """The end every body shares: next weight row, or return; the function's text."""
    f("  br label %rowend")
    f("rowend:")
    f("  %rownext = add i64 %row, 1")
    f("  %rdone = icmp eq i64 %rownext, %r1")
    f("  br i1 %rdone, label %exit, label %rowloop")
    f("exit:")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


# Blocks of 32 a grouped body takes per step: their eight integer sums reduce into
# one <8 x i32> (lane k = block k), met by eight scales at once.
GROUP = 8


def _reduce8(f: _Fn, ps: list[str], sub_scales: tuple[str, str] | None = None) -> str:
    """Eight <8 x i32> partial-sum vectors -> one whose lane k is the total of ps[k]
    (exact integer adds: vphaddd twice, then the two 128-bit halves). After the two
    vphaddd each lane is one half of a vector (lanes 0-3 or 4-7 of ps[k]: with four
    bytes a lane, 16 values): lanes (k, half) (0, 0) (1, 0) (2, 0) (3, 0) (0, 1) (1, 1)
    (2, 1) (3, 1) of ps[0..3], then the same of ps[4..7]; ``sub_scales`` multiplies
    those two vectors lane by lane there (Q3_K's scales per 16 values)."""
    hadd = "call <8 x i32> @llvm.x86.avx2.phadd.d(<8 x i32> {}, <8 x i32> {})"
    s = [f.v(hadd.format(ps[2 * k], ps[2 * k + 1])) for k in range(4)]
    t0, t1 = f.v(hadd.format(s[0], s[1])), f.v(hadd.format(s[2], s[3]))
    if sub_scales is not None:
        t0, t1 = (f.v(f"mul <8 x i32> {t}, {sc}") for t, sc in zip((t0, t1), sub_scales))
    lo = f.v(
        f"shufflevector <8 x i32> {t0}, <8 x i32> {t1}, <8 x i32> <i32 0, i32 1, i32 2, i32 3, i32 8, i32 9, i32 10, i32 11>"
    )
    hi = f.v(
        f"shufflevector <8 x i32> {t0}, <8 x i32> {t1}, <8 x i32> <i32 4, i32 5, i32 6, i32 7, i32 12, i32 13, i32 14, i32 15>"
    )
    return f.v(f"add <8 x i32> {lo}, {hi}")


def _meet8(
    f: _Fn, r: int, b0: str, u: str, w8: str, acc: str, m8: str | None, macc: str | None
) -> tuple[str, str | None]:
    """Eight exact block sums ``u`` (<8 x i32>, lane k = block b0 + k) of input row
    ``r`` meet the eight weight scales ``w8`` times the row's eight activation scales:
    acc + float(u) * w8 * xd[r, b0..b0+8]; with mins ``m8``, macc + m8 * xs[r, b0..b0+8]."""
    xo = f.v(f"add i64 {f.v(f'mul i64 %nb, {r}')}, {b0}")

    def row8(base: str) -> str:
        p = f.v(f"getelementptr float, float* {base}, i64 {xo}")
        return f.v(f"load <8 x float>, <8 x float>* {f.v(f'bitcast float* {p} to <8 x float>*')}, align 4")

    uf = f.v(f"sitofp <8 x i32> {u} to <8 x float>")
    s8 = f.v(f"fmul <8 x float> {w8}, {row8('%xd')}")
    acc = f.v(f"call <8 x float> @llvm.fma.v8f32(<8 x float> {uf}, <8 x float> {s8}, <8 x float> {acc})")
    if m8 is None:
        return acc, None
    return acc, f.v(
        f"call <8 x float> @llvm.fma.v8f32(<8 x float> {m8}, <8 x float> {row8('%xs')}, <8 x float> {macc})"
    )


def _hsum(f: _Fn, v: str) -> str:
    """The lanes of an <8 x float> added in one fixed order."""
    c = f.v(f"fadd <4 x float> {_slice(f, 'float', 8, v, range(4))}, {_slice(f, 'float', 8, v, range(4, 8))}")
    d = f.v(f"fadd <2 x float> {_slice(f, 'float', 4, c, range(2))}, {_slice(f, 'float', 4, c, range(2, 4))}")
    return f.v(
        f"fadd float {f.v(f'extractelement <2 x float> {d}, i32 0')}, {f.v(f'extractelement <2 x float> {d}, i32 1')}"
    )


def _grouped_prologue(f: _Fn, kind: str) -> None:
    """The entry and row loop head every grouped 32-block body shares (``_gbody``,
    ``_zbody``): part pointers by role, row and group counts, then the group loop's
    first line (``%g``, its phis go after it)."""
    wbytes = 16 if _nibbles(kind) else 32
    sd, sm, sh, sq = ops_for(kind).roles
    f(f"  %wd = bitcast i8* %p{sd} to i16*")
    f(f"  %wm = bitcast i8* %p{sd if sm is None else sm} to i16*")
    f(f"  %wq = getelementptr i8, i8* %p{sq}, i64 0")
    f(f"  %wh = bitcast i8* %p{sd if sh is None else sh} to i32*")
    f("  %cols = mul i64 %nb, 32")
    f(f"  %wrow_bytes = mul i64 %nb, {wbytes}")
    f(f"  %pf_ahead = add i64 0, {PREFETCH_BYTES}")
    f("  %xq16 = bitcast i8* %xq to i16*")
    f(f"  %ngroups = udiv i64 %nb, {GROUP}")
    f(f"  %gmain = mul i64 %ngroups, {GROUP}")
    f("  %hastail = icmp slt i64 %gmain, %nb")
    f("  %empty = icmp sge i64 %r0, %r1")
    f("  br i1 %empty, label %exit, label %rowloop")
    f("rowloop:")
    f("  %row = phi i64 [%r0, %entry], [%rownext, %rowend]")
    f("  %wqrow = mul i64 %row, %wrow_bytes")
    f("  %wdrow = mul i64 %row, %nb")
    f("  %hasg = icmp sgt i64 %ngroups, 0")
    f("  br i1 %hasg, label %grp, label %gdone")
    f("grp:")
    f("  %g = phi i64 [0, %rowloop], [%gnext, %grp]")


def _prefetch_group(f: _Fn, wqrow: str, b0: str, wbytes: int) -> None:
    """Prefetch, %pf_ahead bytes ahead, the cache lines of the 8-block group from block
    ``b0`` of the weight row whose quants start at ``wqrow``."""
    gbase = f.v(f"add i64 {wqrow}, {f.v(f'mul i64 {b0}, {wbytes}')}")
    for off in range(0, GROUP * wbytes, 64):
        o = f.v(f"add i64 {gbase}, {off}")
        pp = f.v(f"getelementptr i8, i8* %wq, i64 {f.v(f'add i64 {o}, %pf_ahead')}")
        f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")


def _gbody(kind: str, nx: int, act: int = 8, vnni: bool = False, pairs: bool = False) -> str:
    """The 32-block dtypes (q8, q4, q4_0, q5, q5_1, iq4_nl) for ``nx`` input rows, eight blocks per
    step: the eight exact block sums of an input row reduce into one vector (lane k =
    block k), which meets the eight weight scales (one f16 load and convert) times
    the eight activation scales in one FMA, and q4's mins meet the eight block sums
    of x in another. Per block and input row that leaves the integer multiply and a
    share of the reduction, where the one-block body (``_body``) spends a convert, a
    scalar scale product, a broadcast and an FMA: the part a verify pays per row.
    The nb % 8 leftover blocks take ``_block``. Every input row sums in an order
    fixed by nb alone: row-exact. ``pairs``: ``_pbody``'s eight block sums instead, two
    blocks a 512-bit product (the same integers, so the same bits)."""
    q4 = _min_term(kind)
    wbytes = 16 if _nibbles(kind) else 32
    name = _entry(kind, act)
    f = _Fn(vnni or pairs)
    head = (
        f"@{name}_rows{nx}p({_ARGS}) nounwind alwaysinline" + _ZMM_ATTR
        if pairs
        else f"@{name}_rows{nx}({_ARGS}) nounwind alwaysinline"
    )
    f(f"define internal void {head} {{")
    f("entry:")
    _grouped_prologue(f, kind)
    facc = [f"%facc{r}" for r in range(nx)]
    macc = [f"%macc{r}" for r in range(nx)]
    phi_at = len(f.lines)
    b0 = f.v(f"mul i64 %g, {GROUP}")
    _prefetch_group(f, "%wqrow", b0, wbytes)
    if pairs:
        wpairs = _wpairs(f, b0, wbytes)

        def block_sums(r: int) -> str:
            return _preduce8(f, [_pair_dot(f, r, b, wv) for b, wv in wpairs])

    else:
        wvs = [_wunpack(f, kind, act, f.v(f"add i64 {b0}, {k}"), prefetch=False) for k in range(GROUP)]
        bks = [f.v(f"add i64 {b0}, {k}") for k in range(GROUP)]

        def block_sums(r: int) -> str:
            return _reduce8(f, [_isum(f, kind, act, wvs[k], r, bks[k]) for k in range(GROUP)])

    wdo = f.v(f"add i64 %wdrow, {b0}")

    def half8(base: str) -> str:
        p = f.v(f"getelementptr i16, i16* {base}, i64 {wdo}")
        h = f.v(f"load <8 x half>, <8 x half>* {f.v(f'bitcast i16* {p} to <8 x half>*')}, align 2")
        return f.v(f"fpext <8 x half> {h} to <8 x float>")

    dw8 = half8("%wd")
    mw8 = None
    if _stored_min(kind):
        mw8 = half8("%wm")
    elif q4:
        mw8 = f.v(f"fmul <8 x float> {dw8}, {_splat(f, 'float', 8, f'-{ops_for(kind).zero}.0')}")
    new_f, new_m = [], []
    for r in range(nx):
        a, m = _meet8(f, r, b0, block_sums(r), dw8, facc[r], mw8, macc[r] if q4 else None)
        new_f.append(a)
        if q4:
            new_m.append(m)
    carried = _carried8(facc, new_f, (macc, new_m) if q4 else None)
    _loop_back(f, "%g", "%gnext", "%ngroups", "grp", "rowloop", "gdone", phi_at, carried)
    f("gdone:")
    for r in range(nx):
        f(f"  %gf{r} = phi <8 x float> [zeroinitializer, %rowloop], [{new_f[r]}, %grp]")
        if q4:
            f(f"  %gm{r} = phi <8 x float> [zeroinitializer, %rowloop], [{new_m[r]}, %grp]")
    f("  br i1 %hastail, label %tloop, label %fin")
    tas, tms = _tail_rows(f, kind, act, nx)
    for r in range(nx):
        _store_row(f, r, _hsum(f, f"%gf{r}"), _hsum(f, f"%gm{r}") if q4 else None, tas[r], tms[r])
    return _close_rows(f)


def _splat(f: _Fn, ty: str, n: int, scalar: str) -> str:
    """<n x ty> with every lane ``scalar``."""
    v = f.v(f"insertelement <{n} x {ty}> undef, {ty} {scalar}, i32 0")
    return f.v(f"shufflevector <{n} x {ty}> {v}, <{n} x {ty}> undef, <{n} x i32> zeroinitializer")


def _const(ty: str, n: int, value: int) -> str:
    return "<" + ", ".join([f"{ty} {value}"] * n) + ">"


def _load_at(f: _Fn, ty: str, elem: str, base: str, index: str) -> str:
    """A ``ty`` loaded (align 4) from element ``index`` of ``base``, an ``elem``*."""
    p = f.v(f"getelementptr {elem}, {elem}* {base}, i64 {index}")
    if ty != elem:
        p = f.v(f"bitcast {elem}* {p} to {ty}*")
    return f.v(f"load {ty}, {ty}* {p}, align 4")


def _load32(f: _Fn, base: str, off: str) -> str:
    """32 bytes at base + off as <32 x i8>."""
    p = f.v(f"getelementptr i8, i8* {base}, i64 {off}")
    return f.v(f"load <32 x i8>, <32 x i8>* {f.v(f'bitcast i8* {p} to <32 x i8>*')}, align 1")


def _byte(f: _Fn, base: str, off: str) -> str:
    return f.v(f"load i8, i8* {f.v(f'getelementptr i8, i8* {base}, i64 {off}')}, align 1")


def _k4_scales(f: _Fn, sc: str, o: str) -> list[tuple[str, str]]:
    """The eight 6-bit (scale, min) pairs of the 12 bytes at sc + o, as i8 (get_scale_min_k4)."""
    b = [_byte(f, sc, f.v(f"add i64 {o}, {k}")) for k in range(12)]
    out = []
    for j in range(8):
        if j < 4:
            out.append((f.v(f"and i8 {b[j]}, 63"), f.v(f"and i8 {b[j + 4]}, 63")))
        else:
            hs = f.v(f"shl i8 {f.v(f'lshr i8 {b[j - 4]}, 6')}, 4")
            hm = f.v(f"shl i8 {f.v(f'lshr i8 {b[j]}, 6')}, 4")
            ls, lm = f.v(f"and i8 {b[j + 4]}, 15"), f.v(f"lshr i8 {b[j + 4]}, 4")
            out.append((f.v(f"or i8 {ls}, {hs}"), f.v(f"or i8 {lm}, {hm}")))
    return out


# The K-quant super-block layouts (``_kbody``), by kernel part (``DType.kernel_parts``
# order): the part of the f16 scale d, another f16 part and its register (Q4_K's dmin,
# IQ4_XS's high scale bits), each byte part's bytes per super-block, and the second quant
# stream's share of the first one's bytes (its prefetch distance is that share of
# PREFETCH_BYTES).
_KLAYOUTS = {
    "six": (3, None, {"ql": 128, "qh": 64, "sc": 16}, 2),  # (ql, qh, scales, d)
    "three": (3, None, {"hm": 32, "qs": 64, "sc": 12}, 2),  # (hmask, qs, scales, d)
    "grid": (0, ("ksh", 1), {"sl": 4, "qs": 128}, 0),  # (d, scales_h, scales_l, qs)
    "k4": (0, ("kdm", 1), {"sc": 12, "qs": 128}, 0),  # (d, dmin, scales, qs)
    "k5": (0, ("kdm", 1), {"sc": 12, "qs": 128, "qh": 32}, 4),  # (d, dmin, scales, qh, qs)
}


def _ksuper_prologue(f: _Fn, layout: str, nx: int) -> tuple[list[str], list[str], int, str, str]:
    """The entry and super-block loop head every K-quant body shares: part pointers and row
    strides of ``layout`` (``_KLAYOUTS``), prefetch distances, the row loop, the block loop's
    first line (``%s``, its phis go at the returned line); (accumulator names, min
    accumulator names, that line, the super-block's index, its f16 ``d`` as float)."""
    f("  %xq16 = bitcast i8* %xq to i16*")
    f("  %nsb = udiv i64 %nb, 8")
    f("  %cols = mul i64 %nb, 32")
    d_part, f16_part, row_bytes, second_stream = _KLAYOUTS[layout]
    f(f"  %kd = bitcast i8* %p{d_part} to i16*")
    if f16_part is not None:
        f(f"  %{f16_part[0]} = bitcast i8* %p{f16_part[1]} to i16*")
    for name, nbytes in row_bytes.items():
        f(f"  %{name}_row = mul i64 %nsb, {nbytes}")
    f(f"  %pf_ahead = add i64 0, {PREFETCH_BYTES}")
    if second_stream:
        f(f"  %pf_ahead_h = add i64 0, {PREFETCH_BYTES // second_stream}")
    f("  %empty = icmp sge i64 %r0, %r1")
    f("  br i1 %empty, label %exit, label %rowloop")
    f("rowloop:")
    f("  %row = phi i64 [%r0, %entry], [%rownext, %rowend]")
    f("  %drow = mul i64 %row, %nsb")
    f("  br label %blk")
    f("blk:")
    f("  %s = phi i64 [0, %rowloop], [%snext, %blk]")
    acc = [f"%acc{r}" for r in range(nx)]
    macc = [f"%macc{r}" for r in range(nx)]
    phi_at = len(f.lines)
    di = f.v("add i64 %drow, %s")
    return acc, macc, phi_at, di, _half(f, "%kd", di)


def _kstore_rows(f: _Fn, accs: list[str], maccs: list[str] | None) -> str:
    """The end of a K-quant body's row: out[r, row] = the lanes' sum (less the mins' sum)
    for each input row, then the next row; the function's text."""
    for r, a in enumerate(accs):
        h = _hsum(f, a)
        if maccs is not None:
            h = f.v(f"fsub float {h}, {_hsum(f, maccs[r])}")
        oo = f.v(f"add i64 {f.v(f'mul i64 %ostride, {r}')}, %row")
        f(f"  store float {h}, float* {f.v(f'getelementptr float, float* %out, i64 {oo}')}, align 4")
    return _close_rows(f)


def _kbody(kind: str, nx: int, act: int = 8, vnni: bool = False) -> str:
    """One K-quant super-block body (q4k, q5k, q6k) for ``nx`` input rows on int8
    activations. A super-block holds 8 groups of 32 values, each aligned with one
    activation block, so per (group g, input row) the exact integer sum is taken in
    SIMD; the eight sums of a super-block reduce into one vector (lane g = group g,
    as ``_gbody``) and meet the eight scales (d * sc_g) times the eight activation
    scales in one FMA:  acc += isum * (d * sc * xd)  lane-wise (and, for q4k/q5k,
    macc += (dmin * m) * xs, subtracted at the end). q6k's two signed 8-bit scales
    per group (16 values each) multiply the pair sums in the integer domain
    (``vpmaddwd``), so only its f16 ``d`` meets the float side; q3k's sixteen 6-bit
    scales multiply the 16-value sums halfway through the reduction (``_reduce8``),
    the same integers. The order depends on nothing but the column count: row-exact."""
    rec = ops_for(kind)
    assert rec.kbody and act in rec.int_widths
    six, fifth = rec.ksigned, rec.kfifth  # Q6_K's signed quants and 8-bit scales; Q5_K's fifth bit
    grid = bool(rec.kgrid)  # IQ4_XS: 4-bit indices into a signed grid, 6-bit scales, no mins
    three = rec.kthree  # Q3_K: signed 3-bit quants, two 6-bit scales per 32 (as Q6_K's two 8-bit ones)
    wide = six or three  # signed quants meeting per-16 integer scales in the integer domain
    f = _Fn(vnni)
    mins = not six and not grid and not three
    f(f"define internal void @{_entry(kind, act)}_rows{nx}({_ARGS}) nounwind alwaysinline {{")
    f("entry:")
    layout = "six" if six else "three" if three else "grid" if grid else "k5" if fifth else "k4"
    acc, macc, phi_at, di, dd = _ksuper_prologue(f, layout, nx)
    cur_a, cur_m = acc[:], macc[:]
    groups: list[tuple[str, str, str | None]] = []  # (weights <32 x i8>, float scale, float min)
    sub_scales = None  # q3k on int8 activations: its 16-value scales (_reduce8)
    if six:
        qlo = f.v(f"add i64 {f.v('mul i64 %row, %ql_row')}, {f.v('mul i64 %s, 128')}")
        qho = f.v(f"add i64 {f.v('mul i64 %row, %qh_row')}, {f.v('mul i64 %s, 64')}")
        sco = f.v(f"add i64 {f.v('mul i64 %row, %sc_row')}, {f.v('mul i64 %s, 16')}")
        for off, base, ahead in (("0", "%p0", "%pf_ahead"), ("64", "%p0", "%pf_ahead"), ("0", "%p1", "%pf_ahead_h")):
            src = qlo if base == "%p0" else qho
            o1 = f.v(f"add i64 {src}, {off}")
            pp = f.v(f"getelementptr i8, i8* {base}, i64 {f.v(f'add i64 {o1}, {ahead}')}")
            f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")
        m15, m3 = _const("i8", 32, 15), _const("i8", 32, 3)
        for h in range(2):
            qa = _load32(f, "%p0", f.v(f"add i64 {qlo}, {64 * h}"))
            qb = _load32(f, "%p0", f.v(f"add i64 {qlo}, {64 * h + 32}"))
            qh = _load32(f, "%p1", f.v(f"add i64 {qho}, {32 * h}"))
            for t, (src, shift_lo) in enumerate(((qa, 0), (qb, 0), (qa, 4), (qb, 4))):
                lo = (
                    f.v(f"and <32 x i8> {src}, {m15}")
                    if shift_lo == 0
                    else f.v(f"lshr <32 x i8> {src}, {_const('i8', 32, 4)}")
                )
                hb = qh if t == 0 else f.v(f"lshr <32 x i8> {qh}, {_const('i8', 32, 2 * t)}")
                hb = f.v(f"and <32 x i8> {hb}, {m3}")
                hb = f.v(f"shl <32 x i8> {hb}, {_const('i8', 32, 4)}")
                q = f.v(f"or <32 x i8> {lo}, {hb}")
                w = f.v(f"sub <32 x i8> {q}, {_const('i8', 32, 32)}")
                g = 4 * h + t
                ba = _byte(f, "%p2", f.v(f"add i64 {sco}, {2 * g}"))
                bb = _byte(f, "%p2", f.v(f"add i64 {sco}, {2 * g + 1}"))
                sa, sb = f.v(f"sext i8 {ba} to i16"), f.v(f"sext i8 {bb} to i16")
                groups.append((w, _concat(f, "i16", 8, _splat(f, "i16", 8, sa), _splat(f, "i16", 8, sb)), None))
    elif three:
        qso = f.v(f"add i64 {f.v('mul i64 %row, %qs_row')}, {f.v('mul i64 %s, 64')}")
        hmo = f.v(f"add i64 {f.v('mul i64 %row, %hm_row')}, {f.v('mul i64 %s, 32')}")
        sco = f.v(f"add i64 {f.v('mul i64 %row, %sc_row')}, {f.v('mul i64 %s, 12')}")
        for src, base, ahead in ((qso, "%p1", "%pf_ahead"), (hmo, "%p0", "%pf_ahead_h")):
            pp = f.v(f"getelementptr i8, i8* {base}, i64 {f.v(f'add i64 {src}, {ahead}')}")
            f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")
        hm = _load32(f, "%p0", hmo)
        # The sixteen scales as ggml unpacks them: from the 12 bytes as three words a,
        # b, c, word k of the result is scales 4k..4k+3 (low nibbles of a, b, high
        # nibbles of a, b; top bits from c at shift 2k), in four i32 operations a word.
        sw = []
        for k in range(3):
            p = f.v(f"getelementptr i8, i8* %p2, i64 {f.v(f'add i64 {sco}, {4 * k}')}")
            sw.append(f.v(f"load i32, i32* {f.v(f'bitcast i8* {p} to i32*')}, align 1"))
        words = []
        for k in range(4):
            low = sw[k % 2] if k < 2 else f.v(f"lshr i32 {sw[k % 2]}, 4")
            low = f.v(f"and i32 {low}, {0x0F0F0F0F}")
            top = sw[2] if k == 0 else f.v(f"lshr i32 {sw[2]}, {2 * k}")
            top = f.v(f"shl i32 {f.v(f'and i32 {top}, {0x03030303}')}, 4")
            words.append(f.v(f"or i32 {low}, {top}"))
        v4 = "undef"
        for k, wd in enumerate(words):
            v4 = f.v(f"insertelement <4 x i32> {v4}, i32 {wd}, i32 {k}")
        s8 = f.v(f"sub <16 x i8> {f.v(f'bitcast <4 x i32> {v4} to <16 x i8>')}, {_const('i8', 16, 32)}")
        # int8 activations: the 16-value sums meet their scales in _reduce8's lane order
        # (one vpmulld a row and half super-block); int16: each group's two scales as
        # lanes 0 and 8 of a <16 x i16>, multiplied into the weights as Q6_K's.
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        if act == 8:
            sub_scales = tuple(
                f.v(f"sext <8 x i8> {_slice(f, 'i8', 16, s8, [8 * k + j for j in order])} to <8 x i32>")
                for k in range(2)
            )
        s16 = f.v(f"sext <16 x i8> {s8} to <16 x i16>") if act == 16 else None
        m3, four = _const("i8", 32, 3), _const("i8", 32, 4)
        for h in range(2):
            qv = _load32(f, "%p1", f.v(f"add i64 {qso}, {32 * h}"))
            for t in range(4):
                g = 4 * h + t
                lo = qv if t == 0 else f.v(f"lshr <32 x i8> {qv}, {_const('i8', 32, 2 * t)}")
                lo = f.v(f"and <32 x i8> {lo}, {m3}")
                # a clear high bit (bit g of the hmask byte) subtracts 4
                bit = f.v(f"and <32 x i8> {hm}, {_const('i8', 32, 1 << g)}")
                clear = f.v(f"icmp eq <32 x i8> {bit}, zeroinitializer")
                w = f.v(f"select <32 x i1> {clear}, <32 x i8> {f.v(f'sub <32 x i8> {lo}, {four}')}, <32 x i8> {lo}")
                groups.append((w, _slice(f, "i16", 16, s16, [2 * g] * 8 + [2 * g + 1] * 8) if s16 else None, None))
    elif grid:
        qso = f.v(f"add i64 {f.v('mul i64 %row, %qs_row')}, {f.v('mul i64 %s, 128')}")
        slo = f.v(f"add i64 {f.v('mul i64 %row, %sl_row')}, {f.v('mul i64 %s, 4')}")
        for off in ("0", "64"):
            o1 = f.v(f"add i64 {qso}, {off}")
            pp = f.v(f"getelementptr i8, i8* %p3, i64 {f.v(f'add i64 {o1}, %pf_ahead')}")
            f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")
        shp = f.v(f"getelementptr i16, i16* %ksh, i64 {di}")
        sh = f.v(f"zext i16 {f.v(f'load i16, i16* {shp}, align 2')} to i32")
        for ib in range(8):
            lo = f.v(f"zext i8 {_byte(f, '%p2', f.v(f'add i64 {slo}, {ib // 2}'))} to i32")
            lo = f.v(f"and i32 {f.v(f'lshr i32 {lo}, {4 * (ib % 2)}')}, 15")
            hi = f.v(f"and i32 {f.v(f'lshr i32 {sh}, {2 * ib}')}, 3")
            hi = f.v(f"shl i32 {hi}, 4")
            ls = f.v(f"sub i32 {f.v(f'or i32 {lo}, {hi}')}, 32")
            scf = f.v(f"fmul float {dd}, {f.v(f'sitofp i32 {ls} to float')}")
            idx = _unpack_nibbles(f, f.v(f"getelementptr i8, i8* %p3, i64 {f.v(f'add i64 {qso}, {16 * ib}')}"))
            w = _levels(f, kind, idx)
            groups.append((w, scf, None))
    else:
        qso = f.v(f"add i64 {f.v('mul i64 %row, %qs_row')}, {f.v('mul i64 %s, 128')}")
        sco = f.v(f"add i64 {f.v('mul i64 %row, %sc_row')}, {f.v('mul i64 %s, 12')}")
        for off in ("0", "64"):
            o1 = f.v(f"add i64 {qso}, {off}")
            o2 = f.v(f"add i64 {o1}, %pf_ahead")
            pp = f.v(f"getelementptr i8, i8* %p{4 if fifth else 3}, i64 {o2}")
            f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")
        dm = _half(f, "%kdm", di)
        scm = _k4_scales(f, "%p2", sco)
        qs_p = "%p4" if fifth else "%p3"
        if fifth:
            qho = f.v(f"add i64 {f.v('mul i64 %row, %qh_row')}, {f.v('mul i64 %s, 32')}")
            pp = f.v(f"getelementptr i8, i8* %p3, i64 {f.v(f'add i64 {qho}, %pf_ahead_h')}")
            f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")
            qh = _load32(f, "%p3", qho)
        for k in range(4):
            pk = _load32(f, qs_p, f.v(f"add i64 {qso}, {32 * k}"))
            for half in range(2):
                j = 2 * k + half
                q = (
                    f.v(f"and <32 x i8> {pk}, {_const('i8', 32, 15)}")
                    if half == 0
                    else f.v(f"lshr <32 x i8> {pk}, {_const('i8', 32, 4)}")
                )
                if fifth:
                    hb = qh if j == 0 else f.v(f"lshr <32 x i8> {qh}, {_const('i8', 32, j)}")
                    hb = f.v(f"and <32 x i8> {hb}, {_const('i8', 32, 1)}")
                    hb = f.v(f"shl <32 x i8> {hb}, {_const('i8', 32, 4)}")
                    q = f.v(f"or <32 x i8> {q}, {hb}")
                sc_i, m_i = scm[j]
                scu, mu = f.v(f"uitofp i8 {sc_i} to float"), f.v(f"uitofp i8 {m_i} to float")
                scf, mnf = f.v(f"fmul float {dd}, {scu}"), f.v(f"fmul float {dm}, {mu}")
                groups.append((q, scf, mnf))
    # The eight groups' scales as vectors (lane g = group g), shared by every input row.
    if wide:
        sc8 = _splat(f, "float", 8, dd)
    else:
        sc8 = mn8 = "undef"
        for g, (_, scale, mn) in enumerate(groups):
            sc8 = f.v(f"insertelement <8 x float> {sc8}, float {scale}, i32 {g}")
            if mins:
                mn8 = f.v(f"insertelement <8 x float> {mn8}, float {mn}, i32 {g}")
    aws = [
        f.v(f"call <32 x i8> @llvm.abs.v32i8(<32 x i8> {w}, i1 false)") if (wide or grid) and act == 8 else None
        for w, _, _ in groups
    ]
    if act == 16:
        # int16 activations: each group's weights as two <16 x i16> halves; q6k's two
        # 8-bit scales multiplied in (|(q - 32) * sc| <= 4096 fits i16).
        halves = []
        for w, scale, _ in groups:
            ext = "sext" if wide or grid else "zext"
            hs = []
            for k in range(2):
                hk = f.v(
                    f"shufflevector <32 x i8> {w}, <32 x i8> undef, <16 x i32> <"
                    + ", ".join(f"i32 {16 * k + j}" for j in range(16))
                    + ">"
                )
                hk = f.v(f"{ext} <16 x i8> {hk} to <16 x i16>")
                if wide:
                    sk = f.v(
                        f"shufflevector <16 x i16> {scale}, <16 x i16> undef, <16 x i32> <"
                        + ", ".join([f"i32 {8 * k}"] * 16)
                        + ">"
                    )
                    hk = f.v(f"mul <16 x i16> {hk}, {sk}")
                hs.append(hk)
            halves.append(hs)
    xg0 = f.v("mul i64 %s, 8")
    for r in range(nx):
        ps = []
        for g, (w, scale, _) in enumerate(groups):
            xo = f.v(f"add i64 {f.v(f'mul i64 %cols, {r}')}, {f.v(f'mul i64 {xg0}, 32')}")
            if act == 16:
                xp = f.v(f"getelementptr i16, i16* %xq16, i64 {f.v(f'add i64 {xo}, {32 * g}')}")
                xp1 = f.v(f"getelementptr i16, i16* {xp}, i64 16")
                x0 = f.v(f"load <16 x i16>, <16 x i16>* {f.v(f'bitcast i16* {xp} to <16 x i16>*')}, align 2")
                x1 = f.v(f"load <16 x i16>, <16 x i16>* {f.v(f'bitcast i16* {xp1} to <16 x i16>*')}, align 2")
                ps.append(_dot_i16(f, halves[g][0], x0, halves[g][1], x1))
                continue
            x = _load32(f, "%xq", f.v(f"add i64 {xo}, {32 * g}"))
            if six:
                sx = f.v(f"call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {x}, <32 x i8> {w})")
                p16 = f.v(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {aws[g]}, <32 x i8> {sx})")
                ps.append(f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p16}, <16 x i16> {scale})"))
            elif grid or three:  # signed levels: |w| times x with w's sign (ggml's trick, as q8's)
                sx = f.v(f"call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {x}, <32 x i8> {w})")
                ps.append(_dot_u8s8(f, aws[g], sx))
            else:
                ps.append(_dot_u8s8(f, w, x))
        u = _reduce8(f, ps, sub_scales)
        cur_a[r], m = _meet8(f, r, xg0, u, sc8, cur_a[r], mn8 if mins else None, cur_m[r] if mins else None)
        if mins:
            cur_m[r] = m
    carried = _carried8(acc, cur_a, (macc, cur_m) if mins else None)
    _loop_back(f, "%s", "%snext", "%nsb", "blk", "rowloop", "rowdone", phi_at, carried)
    f("rowdone:")
    return _kstore_rows(f, cur_a, cur_m if mins else None)


# ------------------------------------------------------------ 4-row zmm bodies
# Where the CPU has AVX-512 VNNI, a call of 3 or 4 input rows of q4 / q4_0 takes
# ``_zbody`` (q8: ``_wbody`` below): the rows share every 512-bit dot product. Lane (r, k) of a zmm register holds input
# row r's 16-byte chunk of a block (``interleave_rows`` lays the rows out so), the
# weight chunk is repeated in all four 128-bit lanes, and one vpdpbusd multiplies a
# weight chunk by four rows at once. Four blocks' sums then reduce into
# one register (lane (r, j) = block j of row r) in 9 shuffles and adds, where the
# per-row bodies spend a reduction per row (2.6 of their 5-6 vector instructions per
# block and row). The float side meets scales in the per-row bodies' order: the
# same FMAs on the same values, the same final sum tree, so a row's result in a 4-row
# call is bit for bit its result in a 1-row call.
ZROWS = 4
ZROWS_FROM = 3  # fewer rows keep the per-row bodies (a 4-lane pass would idle half its lanes)
# (dtype, activation width) pairs with this body: q4 and q4_0 on their default int8
# activations, where a weight chunk is one broadcast load, a mask and a shift. q4 4-row
# call on a 5632 x 2048 matrix, one thread: 0.74 -> 0.57 ms (Sapphire Rapids). q8's int16
# chunks would have to be sign-extended and repeated across lanes (8 port-5 shuffles a
# block: 1.37 vs 1.11 ms), so q8 takes ``_wbody`` instead; q5/q5_1 (fifth bits) and the
# K-quants keep the per-row bodies.
ZBODIES = tuple((d, a) for d, o in OPS.items() for a in o.zbody_widths)
ZFEATURES = ("avx512f", "avx512bw", "avx512vnni")
_DECLS_Z = """
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)
declare <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32>, <16 x i32>, <16 x i32>)
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
"""


def _mask(idx) -> str:
    """A shufflevector mask operand: <n x i32> <i32 a, ...>."""
    idx = list(idx)
    return f"<{len(idx)} x i32> <" + ", ".join(f"i32 {i}" for i in idx) + ">"


def _concat(f: _Fn, ty: str, n: int, a: str, b: str) -> str:
    """<2n x ty>: the n lanes of ``a``, then those of ``b``."""
    return f.v(f"shufflevector <{n} x {ty}> {a}, <{n} x {ty}> {b}, {_mask(range(2 * n))}")


def _unpack_nibbles(f: _Fn, wp: str) -> str:
    """The 16 bytes at ``wp`` as <32 x i8>: their low nibbles, then their high ones."""
    pk = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp} to <16 x i8>*')}, align 1")
    return _concat(
        f,
        "i8",
        16,
        f.v(f"and <16 x i8> {pk}, {_const('i8', 16, 15)}"),
        f.v(f"lshr <16 x i8> {pk}, {_const('i8', 16, 4)}"),
    )


def _slice(f: _Fn, ty: str, n: int, v: str, lanes) -> str:
    """The ``lanes`` of the <n x ty> ``v``, as a vector of their own."""
    return f.v(f"shufflevector <{n} x {ty}> {v}, <{n} x {ty}> undef, {_mask(lanes)}")


def _lanes4(f: _Fn, ty: str, v: str, n: int) -> str:
    """<n x ty> -> <4n x ty>: the vector repeated in each of four 128-bit lanes."""
    return f.v(f"shufflevector <{n} x {ty}> {v}, <{n} x {ty}> undef, {_mask(list(range(n)) * 4)}")


def _zpair(f: _Fn, a: str, b: str, level: int) -> str:
    """One level of ``_reduce4z``: level 1 folds two blocks' 4 partial sums per 128-bit
    lane into [a0+a2, b0+b2, a1+a3, b1+b3]; level 2 folds two such into the four totals."""
    if level == 1:
        lo = [x for L in range(4) for x in (4 * L, 16 + 4 * L, 4 * L + 1, 16 + 4 * L + 1)]
        hi = [x for L in range(4) for x in (4 * L + 2, 16 + 4 * L + 2, 4 * L + 3, 16 + 4 * L + 3)]
    else:
        lo = [x for L in range(4) for x in (4 * L, 4 * L + 1, 16 + 4 * L, 16 + 4 * L + 1)]
        hi = [x for L in range(4) for x in (4 * L + 2, 4 * L + 3, 16 + 4 * L + 2, 16 + 4 * L + 3)]
    x = f.v(f"shufflevector <16 x i32> {a}, <16 x i32> {b}, {_mask(lo)}")
    y = f.v(f"shufflevector <16 x i32> {a}, <16 x i32> {b}, {_mask(hi)}")
    return f.v(f"add <16 x i32> {x}, {y}")


def _reduce4z(f: _Fn, vs: list[str]) -> str:
    """Four <16 x i32> vectors, lane (r, k) = partial sum k of row r -> one whose lane
    (r, j) is row r's total of vs[j] (exact integer adds, within 128-bit lanes)."""
    return _zpair(f, _zpair(f, vs[0], vs[1], 1), _zpair(f, vs[2], vs[3], 1), 2)


def _store_row(f: _Fn, r: int, groups: str, mins: str | None, tail: str, tail_min: str | None) -> None:
    """out[r, row] = the grouped blocks' sum (+ their min sum) + the leftover blocks' 8-lane
    sum (+ their min sum), added in this one order by every grouped body: row-exact."""
    h = groups
    if mins is not None:
        h = f.v(f"fadd float {h}, {mins}")
    h = f.v(f"fadd float {h}, {_hsum(f, tail)}")
    if tail_min is not None:
        h = f.v(f"fadd float {h}, {tail_min}")
    oo = f.v(f"add i64 {f.v(f'mul i64 %ostride, {r}')}, %row")
    f(f"  store float {h}, float* {f.v(f'getelementptr float, float* %out, i64 {oo}')}, align 4")


def _tail_rows(f: _Fn, kind: str, act: int, nx: int) -> tuple[list[str], list[str | None]]:
    """The nb % 8 leftover blocks of a grouped body, one at a time per input row
    (``_block``), from ``gdone`` to ``fin``: each row's 8-lane sum and (q4) min sum."""
    q4 = _min_term(kind)
    f("tloop:")
    f("  %tb = phi i64 [%gmain, %gdone], [%tbnext, %tloop]")
    tacc = [f"%tacc{r}" for r in range(nx)]
    tmacc = [f"%tmacc{r}" for r in range(nx)]
    tphi_at = len(f.lines)
    na, nm = _block(f, kind, act, nx, "%tb", tacc, tmacc if q4 else ["0.0"] * nx)
    carried = [(tacc[r], "<8 x float>", "zeroinitializer", na[r]) for r in range(nx)]
    if q4:
        carried += [(tmacc[r], "float", "0.0", nm[r]) for r in range(nx)]
    _loop_back(f, "%tb", "%tbnext", "%nb", "tloop", "gdone", "fin", tphi_at, carried)
    f("fin:")
    # fin's predecessors: gdone (no tail) and tloop; the group sums come from gdone either way
    tas = [f.v(f"phi <8 x float> [zeroinitializer, %gdone], [{na[r]}, %tloop]") for r in range(nx)]
    tms = [f.v(f"phi float [0.0, %gdone], [{nm[r]}, %tloop]") if q4 else None for r in range(nx)]
    return tas, tms


def _hsum_lanes(f: _Fn, a: str, b: str) -> str:
    """``_hsum`` of every 128-bit lane group's 8 values (a's 4 then b's 4), all groups at
    once, in ``_hsum``'s order: lane 4g holds group g's total."""
    c = f.v(f"fadd <16 x float> {a}, {b}")  # c_k = v_k + v_{k+4}
    c2 = f.v(
        f"shufflevector <16 x float> {c}, <16 x float> undef, {_mask([4 * (i // 4) + (i % 4 + 2) % 4 for i in range(16)])}"
    )
    d = f.v(f"fadd <16 x float> {c}, {c2}")  # d0 = c0 + c2, d1 = c1 + c3
    d1 = f.v(
        f"shufflevector <16 x float> {d}, <16 x float> undef, {_mask([4 * (i // 4) + (i % 4 + 1) % 4 for i in range(16)])}"
    )
    return f.v(f"fadd <16 x float> {d}, {d1}")


def _zbody(kind: str, act: int, nx: int) -> str:
    """``kind``'s zmm body for ``nx`` (3 or 4) input rows (see above); the interleaved
    copy's rows past nx are zeros, computed alongside and never stored. Groups of 8 blocks as ``_gbody`` (two
    4-block halves: accumulator A holds blocks 0-3 of every group, B blocks 4-7, so
    A + B is ``_gbody``'s first sum step); the nb % 8 leftover blocks take
    ``_block`` per row, on the per-row layout."""
    assert (kind, act) in ZBODIES and ZROWS_FROM <= nx <= ZROWS
    wbytes, ch = 16, 2  # ZBODIES: nibbles on int8, two 16-byte chunks a block
    name = _entry(kind, act)
    f = _Fn(True)
    f(f'define internal void @{name}_rows{nx}z({_ARGS}) nounwind alwaysinline "min-legal-vector-width"="512" {{')
    f("entry:")
    _grouped_prologue(f, kind)
    names = ["%zA", "%zB", "%zmA", "%zmB"]
    phi_at = len(f.lines)
    b0 = f.v(f"mul i64 %g, {GROUP}")
    _prefetch_group(f, "%wqrow", b0, wbytes)
    new = {}
    for half, (acc, macc) in enumerate((("%zA", "%zmA"), ("%zB", "%zmB"))):
        sums = []
        for j in range(4):
            b = f.v(f"add i64 {b0}, {4 * half + j}")
            bo = f.v(f"mul i64 {b}, {wbytes}")
            wp = f.v(f"getelementptr i8, i8* %wq, i64 {f.v(f'add i64 %wqrow, {bo}')}")
            # the packed nibbles repeated in the four lanes: chunk 0 = low nibbles, 1 = high
            pk = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp} to <16 x i8>*')}, align 1")
            rep = _lanes4(f, "i8", pk, 16)
            wch = [
                f.v(f"and <64 x i8> {rep}, {_const('i8', 64, 15)}"),
                f.v(f"lshr <64 x i8> {rep}, {_const('i8', 64, 4)}"),
            ]
            acc32 = "zeroinitializer"
            bk = f.v(f"mul i64 {b}, {ch}")
            for k in range(ch):
                xo = f.v(f"mul i64 {f.v(f'add i64 {bk}, {k}')}, 64")
                xv = _load_at(f, "<16 x i32>", "i8", "%xt", xo)
                wv = f.v(f"bitcast <64 x i8> {wch[k]} to <16 x i32>")
                # unsigned weights (nibbles) times signed activations
                acc32 = f.v(
                    f"call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {acc32}, <16 x i32> {wv}, <16 x i32> {xv})"
                )
            sums.append(acc32)
        u = _reduce4z(f, sums)
        bh = f.v(f"add i64 {b0}, {4 * half}")
        wdo = f.v(f"add i64 %wdrow, {bh}")

        def half4(base: str) -> str:
            p = f.v(f"getelementptr i16, i16* {base}, i64 {wdo}")
            h = f.v(f"load <4 x half>, <4 x half>* {f.v(f'bitcast i16* {p} to <4 x half>*')}, align 2")
            return _lanes4(f, "float", f.v(f"fpext <4 x half> {h} to <4 x float>"), 4)

        def rows16(base: str) -> str:  # xdt / xst: [nb / 4][4 rows][4 blocks]
            p = f.v(f"getelementptr float, float* {base}, i64 {f.v(f'mul i64 {bh}, 4')}")
            return f.v(f"load <16 x float>, <16 x float>* {f.v(f'bitcast float* {p} to <16 x float>*')}, align 4")

        dw = half4("%wd")
        s = f.v(f"fmul <16 x float> {dw}, {rows16('%xdt')}")
        new[acc] = _fma_isum(f, u, s, acc)
        if _stored_min(kind):
            mw = half4("%wm")
        else:  # q4_0: the min -8 d, exact in f32, as _gbody
            mw = f.v(f"fmul <16 x float> {dw}, {_splat(f, 'float', 16, f'-{ops_for(kind).zero}.0')}")
        new[macc] = f.v(
            f"call <16 x float> @llvm.fma.v16f32(<16 x float> {mw}, <16 x float> {rows16('%xst')}, <16 x float> {macc})"
        )
    carried = [(n, "<16 x float>", "zeroinitializer", new[n]) for n in names]
    _loop_back(f, "%g", "%gnext", "%ngroups", "grp", "rowloop", "gdone", phi_at, carried)
    f("gdone:")
    for n in names:
        f(f"  {n}_end = phi <16 x float> [zeroinitializer, %rowloop], [{new[n]}, %grp]")
    f("  br i1 %hastail, label %tloop, label %fin")
    tas, tms = _tail_rows(f, kind, act, nx)  # per row on the per-row layout, as _gbody's

    hf = _hsum_lanes(f, "%zA_end", "%zB_end")
    hm = _hsum_lanes(f, "%zmA_end", "%zmB_end")
    for r in range(nx):
        lane = lambda v: f.v(f"extractelement <16 x float> {v}, i32 {4 * r}")  # noqa: E731
        _store_row(f, r, lane(hf), lane(hm), tas[r], tms[r])
    return _close_rows(f)


# ------------------------------------------------------------ 1- and 2-row zmm bodies
# A decode step (one input row) and a 2-row verify of q4 / q4_0 on AVX-512 VNNI: two
# blocks a zmm. 32 bytes of packed nibbles (two blocks) unpack into [block 0 low
# nibbles, block 0 high, block 1 low, block 1 high], the order of the 64 contiguous
# activation bytes of those two blocks, so one vpdpbusd multiplies two blocks by an input
# row with no copy of the activations; lanes 0-7 hold block 0's partial sums, 8-15
# block 1's. Eight blocks' sums then reduce into one <8 x i32> (lane k = block k) in 12
# shuffles and adds, where ``_gbody`` spends eight 256-bit products and six vphaddd
# (three uops each on Zen). The exact block sums meet the scales through ``_meet8`` and
# the leftover blocks through ``_tail_rows``, ``_gbody``'s own float steps: the same bits.
# q4_0 1-row call, 32768 x 2048 (Zen 5): one thread 1.28 -> 1.10 ms, two 0.65 -> 0.47 ms;
# 22 layers of TinyLlama's matrices streamed from memory, 2 threads, alternating with
# the per-row bodies (a shared host's bandwidth moved 38-70 GB/s between runs): 1 row
# 1.09x, 2 rows 1.16x faster, the 1-row call then bound by memory.
PROWS = 2
_ZMM_ATTR = ' "min-legal-vector-width"="512"'


def _fold128(f: _Fn, a: str, b: str) -> str:
    """Two <16 x i32> vectors -> their 128-bit lanes added in pairs:
    [a.0 + a.1, a.2 + a.3, b.0 + b.1, b.2 + b.3] (exact integer adds)."""
    even = [x for L in (0, 2, 4, 6) for x in range(4 * L, 4 * L + 4)]
    odd = [x for L in (1, 3, 5, 7) for x in range(4 * L, 4 * L + 4)]
    x = f.v(f"shufflevector <16 x i32> {a}, <16 x i32> {b}, {_mask(even)}")
    y = f.v(f"shufflevector <16 x i32> {a}, <16 x i32> {b}, {_mask(odd)}")
    return f.v(f"add <16 x i32> {x}, {y}")


def _lane_pairs(f: _Fn, a: str, b: str, lo: tuple[int, int], hi: tuple[int, int]) -> str:
    """Within each 128-bit lane L of two <16 x i32> vectors:
    [a.lo0 + a.hi0, a.lo1 + a.hi1, b.lo0 + b.hi0, b.lo1 + b.hi1] (exact integer adds)."""
    x = [e for L in range(4) for e in (4 * L + lo[0], 4 * L + lo[1], 16 + 4 * L + lo[0], 16 + 4 * L + lo[1])]
    y = [e for L in range(4) for e in (4 * L + hi[0], 4 * L + hi[1], 16 + 4 * L + hi[0], 16 + 4 * L + hi[1])]
    sx = f.v(f"shufflevector <16 x i32> {a}, <16 x i32> {b}, {_mask(x)}")
    return f.v(f"add <16 x i32> {sx}, {f.v(f'shufflevector <16 x i32> {a}, <16 x i32> {b}, {_mask(y)}')}")


def _preduce8(f: _Fn, vs: list[str]) -> str:
    """Four <16 x i32> vectors, vs[j] lanes 0-7 = partial sums of block 2j and 8-15 of
    block 2j + 1 -> <8 x i32> whose lane k is block k's total (exact integer adds)."""
    s0, s1 = _fold128(f, vs[0], vs[1]), _fold128(f, vs[2], vs[3])  # 128-bit lane L: block L / block 4 + L
    r = _lane_pairs(f, s0, s1, (0, 1), (2, 3))  # lane L: two partials of block L, two of block 4 + L
    e = f.v(f"shufflevector <16 x i32> {r}, <16 x i32> undef, {_mask([0, 4, 8, 12, 2, 6, 10, 14])}")
    o = f.v(f"shufflevector <16 x i32> {r}, <16 x i32> undef, {_mask([1, 5, 9, 13, 3, 7, 11, 15])}")
    return f.v(f"add <8 x i32> {e}, {o}")


def _wpairs(f: _Fn, b0: str, wbytes: int) -> list[tuple[str, str]]:
    """The group from block ``b0`` of the current row, two nibble blocks a 512-bit operand
    in the order of their 64 activation bytes: (first block, <16 x i32>) per pair."""
    pairs = []
    for j in range(GROUP // 2):
        b = f.v(f"add i64 {b0}, {2 * j}")
        pk = _load32(f, "%wq", f.v(f"add i64 %wqrow, {f.v(f'mul i64 {b}, {wbytes}')}"))
        lo = f.v(f"and <32 x i8> {pk}, {_const('i8', 32, 15)}")
        hi = f.v(f"lshr <32 x i8> {pk}, {_const('i8', 32, 4)}")
        order = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
        w = f.v(f"shufflevector <32 x i8> {lo}, <32 x i8> {hi}, {_mask(order)}")
        pairs.append((b, f.v(f"bitcast <64 x i8> {w} to <16 x i32>")))
    return pairs


def _pair_dot(f: _Fn, r: int, b: str, wv: str) -> str:
    """Blocks b and b + 1 of input row ``r`` times the weight pair ``wv``: one vpdpbusd."""
    xo = f.v(f"add i64 {f.v(f'mul i64 %cols, {r}')}, {f.v(f'mul i64 {b}, 32')}")
    xv = _load_at(f, "<16 x i32>", "i8", "%xq", xo)
    return f.v(
        f"call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, <16 x i32> {wv}, <16 x i32> {xv})"
    )


def _pbody(kind: str, act: int, nx: int) -> str:
    """``kind``'s zmm body for ``nx`` (1 or 2) input rows (see above): ``_gbody``'s loop
    with the eight block sums of a group computed two blocks a vpdpbusd."""
    assert (kind, act) in ZBODIES and 1 <= nx <= PROWS and _min_term(kind)
    return _gbody(kind, nx, act, True, pairs=True)


# ------------------------------------------------------------ K-quant 1- and 2-row zmm bodies
# A decode step and a 2-row verify of q4k (int8 activations) and q6k (int16, and int8) on
# AVX-512 VNNI, which ``_kbody`` leaves compute-bound. q4k: a super-block's 32-byte chunk
# k holds group 2k in its low nibbles and 2k + 1 in its high ones, the order of the 64
# contiguous activation bytes of those groups: the chunk broadcast to both halves of a
# zmm, the upper half shifted by 4 (one vpsrlvq) and masked, meets them in one vpdpbusd,
# and ``_preduce8`` gives the eight group sums (2 rows: ``_half_tree`` both rows'). Its
# 6-bit scales and mins unpack as ggml's four words (scalar i32 operations: in vector
# registers they made 2-row calls 7% slower), converted and scaled eight lanes at a
# time: the per-row body's scalar products, lane for lane. q6k: 64 bytes of low bits are two
# groups' (one zmm, both nibble halves), the high bits broadcast likewise. On int16 each
# group's 32 products are one vpdpwssd (where ``_kbody`` spends two 256-bit ones and a
# vpmullw per half for its 8-bit scales); on int8 two groups' are one vpdpbusd (no
# 512-bit vpsignb: x + 128 times the signed weights, from -128 times the weights' sums).
# One reduction tree then gives the sixteen 16-value sums in an order the scales are
# shuffled to once, one vpmulld meets them, and a pair add gives the eight group sums.
# The integer group sums are exactly ``_kbody``'s; they meet the scales through
# ``_meet8`` (2-row calls: both rows' sixteen lanes at once, the same operations lane for
# lane) and the rows end as ``_kbody``'s do: the same bits. Zen 5, one process alternating
# with the per-row bodies (medians of 9 rounds), 2 threads (1 thread): a 49152 x 2048 q6k
# matrix, int16, 1 row 2.15 -> 1.38 ms (38 -> 60 GB/s) 1.56x (1.55x), 2 rows 1.48x
# (1.47x); int8 1.62x (1.54x), 2 rows 2.15x (2.03x). 22 layers of TinyLlama's matrices in
# q4k, streamed from memory: 1 row 19.6 -> 10.1 ms (28 -> 54 GB/s) 1.94x (2.04x), 2 rows
# 2.05x (2.03x). Gemma 3 270M Q4_K_M, whose K-quant matrices are 23 of its 247 MB: a
# decode step 1.05x.
KPBODIES = (("q4k", 8), ("q6k", 16), ("q6k", 8))


# Lane 4L + i of ``_half_tree``'s sixteen sums: half 2i + (L % 2) + 8 (L // 2).
HALF_ORDER = tuple(2 * i + L % 2 + 8 * (L // 2) for L in range(4) for i in range(4))


def _half_tree(f: _Fn, ps: list[str]) -> str:
    """Eight <16 x i32> vectors, ps[g] lanes 0-7 = partial sums of item 2g and 8-15 of item
    2g + 1 -> <16 x i32> whose lane 4L + i is the total of item HALF_ORDER[4L + i] (exact
    integer adds: 21 shuffles and adds within 128-bit lanes or of whole ones)."""
    # 128-bit lanes of the folds: halves [0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]
    s = [_fold128(f, ps[k], ps[k + 4]) for k in range(4)]
    # two partials each: lane L of r0 halves (0, 2), (1, 3), (8, 10), (9, 11); r1 the same + 4
    r0, r1 = _lane_pairs(f, s[0], s[1], (0, 1), (2, 3)), _lane_pairs(f, s[2], s[3], (0, 1), (2, 3))
    return _lane_pairs(f, r0, r1, (0, 2), (1, 3))


# Lane 4c + i of ``_quarter_tree``'s sixteen 16-value sums: half 4i + c.
QUARTER_ORDER = tuple(4 * i + c for c in range(4) for i in range(4))


def _quarter_tree(f: _Fn, ps: list[str]) -> str:
    """Four <16 x i32> vectors, 128-bit lane c of ps[k] = partial sums of half 4k + c
    (16 values of group 2k + c // 2) -> <16 x i32> whose lane 4c + i is the total of half
    QUARTER_ORDER[4c + i] (exact integer adds within 128-bit lanes)."""
    # lane c: two partials each of halves c and 4 + c (a), 8 + c and 12 + c (b)
    a, b = _lane_pairs(f, ps[0], ps[1], (0, 1), (2, 3)), _lane_pairs(f, ps[2], ps[3], (0, 1), (2, 3))
    return _lane_pairs(f, a, b, (0, 2), (1, 3))


def _group_pairs(f: _Fn, ts: list[str], order: tuple[int, ...]) -> str:
    """<16 x i32> vectors ts[r], lane j = input row r's (scaled) half order[j] -> one
    vector whose lane 8r + g is row r's halves 2g + 2g + 1: group g's sum (<8 x i32> for
    one row, <16 x i32> for two)."""
    a = [order.index(2 * g) for g in range(8)]
    b = [order.index(2 * g + 1) for g in range(8)]
    other = ts[1] if len(ts) == 2 else "undef"
    if len(ts) == 2:
        a, b = a + [16 + i for i in a], b + [16 + i for i in b]
    n = 8 * len(ts)
    x = f.v(f"shufflevector <16 x i32> {ts[0]}, <16 x i32> {other}, {_mask(a)}")
    y = f.v(f"shufflevector <16 x i32> {ts[0]}, <16 x i32> {other}, {_mask(b)}")
    return f.v(f"add <{n} x i32> {x}, {y}")


def _kpbody(kind: str, act: int, nx: int) -> str:
    """``kind``'s K-quant zmm body for ``nx`` (1 or 2) input rows (see above): ``_kbody``'s
    super-block loop and float steps, the integer group sums two groups a 512-bit product."""
    assert (kind, act) in KPBODIES and 1 <= nx <= PROWS
    six = ops_for(kind).ksigned
    f = _Fn(True)
    f(f"define internal void @{_entry(kind, act)}_rows{nx}k({_ARGS}) nounwind alwaysinline{_ZMM_ATTR} {{")
    f("entry:")
    acc, macc, phi_at, di, dd = _ksuper_prologue(f, "six" if six else "k4", nx)
    cur_a, cur_m = acc[:], macc[:]
    xg0 = f.v("mul i64 %s, 8")

    def prefetch(base: str, off: str, ahead: str) -> None:
        pp = f.v(f"getelementptr i8, i8* {base}, i64 {f.v(f'add i64 {off}, {ahead}')}")
        f(f"  call void @llvm.prefetch.p0i8(i8* {pp}, i32 0, i32 3, i32 1)")

    def load(ty: str, base: str, off: str) -> str:
        p = f.v(f"getelementptr i8, i8* {base}, i64 {off}")
        return f.v(f"load {ty}, {ty}* {f.v(f'bitcast i8* {p} to {ty}*')}, align 1")

    def both_halves(v32: str, shift: int) -> str:
        """<64 x i8>: the 32 bytes ``v32``, then the same shifted right by ``shift`` bits
        (whole qwords: the caller masks what crosses a byte)."""
        rep = f.v(f"bitcast <64 x i8> {_concat(f, 'i8', 32, v32, v32)} to <8 x i64>")
        sh = "<" + ", ".join(["i64 0"] * 4 + [f"i64 {shift}"] * 4) + ">"
        return f.v(f"bitcast <8 x i64> {f.v(f'lshr <8 x i64> {rep}, {sh}')} to <64 x i8>")

    def xrow(r: int, g: int) -> str:
        """Input row r's activations from group g of the super-block, 64 bytes."""
        xo = f.v(f"add i64 {f.v(f'mul i64 %cols, {r}')}, {f.v(f'mul i64 {xg0}, 32')}")
        if act == 8:
            return load("<16 x i32>", "%xq", f.v(f"add i64 {xo}, {32 * g}"))
        xp = f.v(f"getelementptr i16, i16* %xq16, i64 {f.v(f'add i64 {xo}, {32 * g}')}")
        return f.v(f"load <16 x i32>, <16 x i32>* {f.v(f'bitcast i16* {xp} to <16 x i32>*')}, align 2")

    def dot(kind_: str, w: str, x: str, acc: str = "zeroinitializer") -> str:
        return f.v(f"call <16 x i32> @llvm.x86.avx512.{kind_}.512(<16 x i32> {acc}, <16 x i32> {w}, <16 x i32> {x})")

    if six:
        qlo = f.v(f"add i64 {f.v('mul i64 %row, %ql_row')}, {f.v('mul i64 %s, 128')}")
        qho = f.v(f"add i64 {f.v('mul i64 %row, %qh_row')}, {f.v('mul i64 %s, 64')}")
        sco = f.v(f"add i64 {f.v('mul i64 %row, %sc_row')}, {f.v('mul i64 %s, 16')}")
        prefetch("%p0", qlo, "%pf_ahead")
        prefetch("%p0", f.v(f"add i64 {qlo}, 64"), "%pf_ahead")
        prefetch("%p1", qho, "%pf_ahead_h")
        # group g = 4h + t: t 0 / 1 the low nibbles of ql bytes 64h.. / 64h + 32.., t 2 / 3
        # their high nibbles; the high bits 2t of qh bytes 32h..
        wpairs = []  # <64 x i8> (q - 32) of groups 2k, 2k + 1
        for h in range(2):
            ql = load("<64 x i8>", "%p0", f.v(f"add i64 {qlo}, {64 * h}"))
            qh = both_halves(load("<32 x i8>", "%p1", f.v(f"add i64 {qho}, {32 * h}")), 2)
            lo = f.v(f"and <64 x i8> {ql}, {_const('i8', 64, 15)}")
            hb = f.v(f"shl <64 x i8> {qh}, {_const('i8', 64, 4)}")
            hb = f.v(f"and <64 x i8> {hb}, {_const('i8', 64, 48)}")
            w01 = f.v(f"sub <64 x i8> {f.v(f'or <64 x i8> {lo}, {hb}')}, {_const('i8', 64, 32)}")
            hi = f.v(f"lshr <64 x i8> {ql}, {_const('i8', 64, 4)}")
            hb2 = f.v(f"and <64 x i8> {qh}, {_const('i8', 64, 48)}")
            w23 = f.v(f"sub <64 x i8> {f.v(f'or <64 x i8> {hi}, {hb2}')}, {_const('i8', 64, 32)}")
            wpairs += [w01, w23]
        sc8 = _splat(f, "float", 8, dd)
    if six and act == 8:
        # vpdpbusd multiplies unsigned by signed bytes: x + 128 (x xor 0x80) by the signed
        # weights, from an accumulator of -128 times the weights' four-byte sums (the
        # weights' share, once for both rows): exactly x . w, lane for lane
        sc16 = _slice(f, "i8", 16, load("<16 x i8>", "%p2", sco), QUARTER_ORDER)
        sc16 = f.v(f"sext <16 x i8> {sc16} to <16 x i32>")
        wv = [f.v(f"bitcast <64 x i8> {w} to <16 x i32>") for w in wpairs]
        flip = _const("i32", 16, -0x7F7F7F80)  # 0x80808080
        base = [f.v(f"sub <16 x i32> zeroinitializer, {dot('vpdpbusd', flip, w)}") for w in wv]
        ts = []
        for r in range(nx):
            ps = []
            for k, w in enumerate(wv):
                xu = f.v(f"xor <16 x i32> {xrow(r, 2 * k)}, {flip}")
                ps.append(dot("vpdpbusd", xu, w, base[k]))
            ts.append(f.v(f"mul <16 x i32> {_quarter_tree(f, ps)}, {sc16}"))
        u = _group_pairs(f, ts, QUARTER_ORDER)
    elif six:
        wgroups = [  # <32 x i16> per group
            f.v(f"sext <32 x i8> {_slice(f, 'i8', 64, w, range(32 * k, 32 * k + 32))} to <32 x i16>")
            for w in wpairs
            for k in range(2)
        ]
        # the sixteen 8-bit scales in the half sums' lane order (_half_tree)
        sc16 = _slice(f, "i8", 16, load("<16 x i8>", "%p2", sco), HALF_ORDER)
        sc16 = f.v(f"sext <16 x i8> {sc16} to <16 x i32>")
        ts = []
        for r in range(nx):
            ps = [
                dot("vpdpwssd", f.v(f"bitcast <32 x i16> {w} to <16 x i32>"), xrow(r, g)) for g, w in enumerate(wgroups)
            ]
            ts.append(f.v(f"mul <16 x i32> {_half_tree(f, ps)}, {sc16}"))
        u = _group_pairs(f, ts, HALF_ORDER)
    else:
        qso = f.v(f"add i64 {f.v('mul i64 %row, %qs_row')}, {f.v('mul i64 %s, 128')}")
        sco = f.v(f"add i64 {f.v('mul i64 %row, %sc_row')}, {f.v('mul i64 %s, 12')}")
        prefetch("%p3", qso, "%pf_ahead")
        prefetch("%p3", f.v(f"add i64 {qso}, 64"), "%pf_ahead")
        dm = _half(f, "%kdm", di)
        # ggml's unpacking of the twelve scale bytes as words a, b, c: scales 0-3 and 4-7,
        # then mins 0-3 and 4-7, one byte each (_k4_scales, four lanes at a time)
        a, b, c = (load("i32", "%p2", f.v(f"add i64 {sco}, {4 * k}")) for k in range(3))
        m6, m4, m2 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303

        def top2(v: str) -> str:
            t = f.v(f"lshr i32 {v}, 6")
            return f.v(f"shl i32 {f.v(f'and i32 {t}, {m2}')}, 4")

        c4 = f.v(f"lshr i32 {c}, 4")
        words = [
            f.v(f"and i32 {a}, {m6}"),
            f.v(f"or i32 {f.v(f'and i32 {c}, {m4}')}, {top2(a)}"),
            f.v(f"and i32 {b}, {m6}"),
            f.v(f"or i32 {f.v(f'and i32 {c4}, {m4}')}, {top2(b)}"),
        ]
        v4 = "undef"
        for k, wd in enumerate(words):
            v4 = f.v(f"insertelement <4 x i32> {v4}, i32 {wd}, i32 {k}")
        sm = f.v(f"uitofp <16 x i8> {f.v(f'bitcast <4 x i32> {v4} to <16 x i8>')} to <16 x float>")
        dd8, dm8 = _splat(f, "float", 8, dd), _splat(f, "float", 8, dm)
        sc8 = f.v(f"fmul <8 x float> {dd8}, {_slice(f, 'float', 16, sm, range(8))}")
        mn8 = f.v(f"fmul <8 x float> {dm8}, {_slice(f, 'float', 16, sm, range(8, 16))}")
        ws = []
        for k in range(4):
            w = both_halves(load("<32 x i8>", "%p3", f.v(f"add i64 {qso}, {32 * k}")), 4)
            w = f.v(f"and <64 x i8> {w}, {_const('i8', 64, 15)}")
            ws.append(f.v(f"bitcast <64 x i8> {w} to <16 x i32>"))
        if nx == 2:  # both rows' sixteen group sums in one tree (lane 8r + g)
            ps = [dot("vpdpbusd", w, xrow(r, 2 * k)) for r in range(2) for k, w in enumerate(ws)]
            u = _slice(f, "i32", 16, _half_tree(f, ps), [HALF_ORDER.index(j) for j in range(16)])
        else:
            u = _preduce8(f, [dot("vpdpbusd", w, xrow(0, 2 * k)) for k, w in enumerate(ws)])
    mins = not six
    if nx == 1:
        cur_a[0], cur_m[0] = _meet8(f, 0, xg0, u, sc8, acc[0], mn8 if mins else None, macc[0] if mins else None)
        carried = _carried8(acc, cur_a, (macc, cur_m) if mins else None)
    else:
        # two rows' float steps sixteen lanes at a time (lane 8r + g): _meet8's operations
        # on the same values, lane for lane
        def rows16(base: str) -> str:
            h = []
            for r in range(2):
                xo = f.v(f"add i64 {f.v(f'mul i64 %nb, {r}')}, {xg0}")
                p = f.v(f"getelementptr float, float* {base}, i64 {xo}")
                h.append(f.v(f"load <8 x float>, <8 x float>* {f.v(f'bitcast float* {p} to <8 x float>*')}, align 4"))
            return _concat(f, "float", 8, h[0], h[1])

        def fma16(a: str, b: str, c: str) -> str:
            return f.v(f"call <16 x float> @llvm.fma.v16f32(<16 x float> {a}, <16 x float> {b}, <16 x float> {c})")

        s16 = f.v(f"fmul <16 x float> {_concat(f, 'float', 8, sc8, sc8)}, {rows16('%xd')}")
        a16 = fma16(f.v(f"sitofp <16 x i32> {u} to <16 x float>"), s16, "%acc16")
        carried = [("%acc16", "<16 x float>", "zeroinitializer", a16)]
        if mins:
            m16 = fma16(_concat(f, "float", 8, mn8, mn8), rows16("%xs"), "%macc16")
            carried.append(("%macc16", "<16 x float>", "zeroinitializer", m16))
    _loop_back(f, "%s", "%snext", "%nsb", "blk", "rowloop", "rowdone", phi_at, carried)
    f("rowdone:")
    if nx == 2:
        cur_a = [_slice(f, "float", 16, a16, range(8 * r, 8 * r + 8)) for r in range(2)]
        if mins:
            cur_m = [_slice(f, "float", 16, m16, range(8 * r, 8 * r + 8)) for r in range(2)]
    return _kstore_rows(f, cur_a, cur_m if mins else None)


# ------------------------------------------------------------ q8: 4 weight rows at a time
# q8's int16 quants cannot be repeated across lanes cheaply (``ZBODIES``), so its zmm
# body turns the layout around: lane (w, k) holds weight row w's k-th pair sums, four
# weight rows side by side (one vpmovsxbw per row and block, then a 4 x 4 transpose of
# 128-bit lanes: 8 vshufi64x2 a block for all four rows), and each input row's chunk is
# repeated across the lanes by a broadcast load (no shuffle). One vpdpwssd then
# multiplies a chunk of four weight rows by one input row; four blocks reduce as in
# ``_zbody``. The float side replays ``_gbody`` / ``_block`` per (weight row, input row)
# lane for lane: row-exact, the per-row bodies' bits. Rows of the call's range past a
# multiple of 4 take the per-row body.
# q8 4-row call, 5632 x 2048, one thread: 1.06-1.11 -> 0.86-0.89 ms, 8 rows 2.18 -> 1.6.
WROWS_KINDS = tuple((d, a) for d, o in OPS.items() for a in o.wbody_widths)
# Prefetch distance of the four side-by-side rows: the band's last row plus PREFETCH_BYTES
# (PREFETCH_BYTES alone lands inside the band: a 1.1B 4-row verify took 88 ms, this 65-73,
# the per-row bodies 78-80).
WBAND_AHEAD_ROWS = 3
WBAND_AHEAD_BYTES = PREFETCH_BYTES


def _fma_isum(f: _Fn, isum: str, scale: str, acc: str) -> str:
    """acc + float(isum) * scale, lane-wise, for <16 x i32> integer sums."""
    uf = f.v(f"sitofp <16 x i32> {isum} to <16 x float>")
    return f.v(f"call <16 x float> @llvm.fma.v16f32(<16 x float> {uf}, <16 x float> {scale}, <16 x float> {acc})")


def _lanes_pick(f: _Fn, a: str, b: str, lanes: tuple[int, int, int, int]) -> str:
    """<32 x i16> from the 128-bit lanes of a (0-3) and b (4-7)."""
    idx = [8 * L + e if L < 4 else 32 + 8 * (L - 4) + e for L in lanes for e in range(8)]
    return f.v(f"shufflevector <32 x i16> {a}, <32 x i16> {b}, {_mask(idx)}")


def _wbody(kind: str, act: int, nx: int) -> str:
    assert (kind, act) in WROWS_KINDS and ZROWS_FROM <= nx <= ZROWS
    name = _entry(kind, act)
    f = _Fn(True)
    f(f'define internal void @{name}_rows{nx}w({_ARGS}) nounwind alwaysinline "min-legal-vector-width"="512" {{')
    f("entry:")
    f("  %wd = bitcast i8* %p0 to i16*")
    f("  %wq = getelementptr i8, i8* %p1, i64 0")
    f("  %cols = mul i64 %nb, 32")
    f("  %wrow_bytes = mul i64 %nb, 32")
    # The four rows stream side by side: ahead of them lies the next band of four rows.
    f(f"  %pf_ahead = add i64 {f.v(f'mul i64 %wrow_bytes, {WBAND_AHEAD_ROWS}')}, {WBAND_AHEAD_BYTES}")
    f("  %xq16 = bitcast i8* %xq to i16*")
    f(f"  %ngroups = udiv i64 %nb, {GROUP}")
    f(f"  %gmain = mul i64 %ngroups, {GROUP}")
    f("  %hastail = icmp slt i64 %gmain, %nb")
    f("  %hasg = icmp sgt i64 %ngroups, 0")
    f("  %span = sub i64 %r1, %r0")
    f("  %n4 = and i64 %span, -4")
    f("  %r4 = add i64 %r0, %n4")
    f("  %has4 = icmp sgt i64 %n4, 0")
    f("  br i1 %has4, label %rowloop, label %rest")
    f("rowloop:")
    f("  %row = phi i64 [%r0, %entry], [%rownext, %rowend]")
    for w in range(4):
        f(f"  %wrow{w} = add i64 %row, {w}")
        f(f"  %wqrow{w} = mul i64 %wrow{w}, %wrow_bytes")
        f(f"  %wdrow{w} = mul i64 %wrow{w}, %nb")
    f("  br i1 %hasg, label %grp, label %gdone")

    def wblock(b: str) -> list[str]:
        """Block b of the four weight rows, transposed: T_k lane w = row w's chunk k."""
        z = []
        for w in range(4):
            o = f.v(f"add i64 %wqrow{w}, {f.v(f'mul i64 {b}, 32')}")
            p = f.v(f"getelementptr i8, i8* %wq, i64 {o}")
            v = f.v(f"load <32 x i8>, <32 x i8>* {f.v(f'bitcast i8* {p} to <32 x i8>*')}, align 1")
            z.append(f.v(f"sext <32 x i8> {v} to <32 x i16>"))
        u01, v01 = _lanes_pick(f, z[0], z[1], (0, 1, 4, 5)), _lanes_pick(f, z[0], z[1], (2, 3, 6, 7))
        u23, v23 = _lanes_pick(f, z[2], z[3], (0, 1, 4, 5)), _lanes_pick(f, z[2], z[3], (2, 3, 6, 7))
        t = [
            _lanes_pick(f, u01, u23, (0, 2, 4, 6)),
            _lanes_pick(f, u01, u23, (1, 3, 5, 7)),
            _lanes_pick(f, v01, v23, (0, 2, 4, 6)),
            _lanes_pick(f, v01, v23, (1, 3, 5, 7)),
        ]
        return [f.v(f"bitcast <32 x i16> {x} to <16 x i32>") for x in t]

    def xchunk(r: int, b: str, k: int) -> str:
        """Input row r's chunk k of block b, repeated in the four lanes (a broadcast load)."""
        bo = f.v(f"mul i64 {b}, 32")
        o = f.v(f"add i64 {f.v(f'mul i64 %cols, {r}')}, {f.v(f'add i64 {bo}, {8 * k}')}")
        p = f.v(f"getelementptr i16, i16* %xq16, i64 {o}")
        v = f.v(f"load <8 x i16>, <8 x i16>* {f.v(f'bitcast i16* {p} to <8 x i16>*')}, align 2")
        return f.v(f"bitcast <32 x i16> {_lanes4(f, 'i16', v, 8)} to <16 x i32>")

    def vdp(acc: str, a: str, b: str) -> str:
        # Inline asm: LLVM otherwise splits a chain of vpdpwssd into vpmaddwd + vpaddd (two
        # port-0/5 uops for one).
        if acc == "zeroinitializer":
            return f.v(
                f"call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> zeroinitializer, <16 x i32> {a}, <16 x i32> {b})"
            )
        return f.v(
            f'call <16 x i32> asm "vpdpwssd $2, $1, $0", "=v,v,v,0"(<16 x i32> {a}, <16 x i32> {b}, <16 x i32> {acc})'
        )

    def dw16(b0: str, width: int) -> str:
        """lane (w, j) = weight row w's scale of block b0 + j (width 4), or of block b0 (width 1)."""
        parts = []
        for w in range(4):
            p = f.v(f"getelementptr i16, i16* %wd, i64 {f.v(f'add i64 %wdrow{w}, {b0}')}")
            if width == 4:
                h = f.v(f"load <4 x half>, <4 x half>* {f.v(f'bitcast i16* {p} to <4 x half>*')}, align 2")
                parts.append(f.v(f"fpext <4 x half> {h} to <4 x float>"))
            else:
                h = f.v(f"load half, half* {f.v(f'bitcast i16* {p} to half*')}, align 2")
                parts.append(_splat(f, "float", 4, f.v(f"fpext half {h} to float")))
        lo = _concat(f, "float", 4, parts[0], parts[1])
        return _concat(f, "float", 8, lo, _concat(f, "float", 4, parts[2], parts[3]))

    # ---- groups of 8 blocks
    f("grp:")
    f("  %g = phi i64 [0, %rowloop], [%gnext, %grp]")
    accs = {(r, h): f"%wa{r}_{h}" for r in range(nx) for h in range(2)}
    phi_at = len(f.lines)
    b0 = f.v(f"mul i64 %g, {GROUP}")
    for w in range(4):
        _prefetch_group(f, f"%wqrow{w}", b0, 32)
    new = {}
    for half in range(2):
        # blocks two at a time, each pair folded at once: fewer live registers (32 zmm)
        folded: dict[int, list[str]] = {r: [] for r in range(nx)}
        for jp in range(2):
            ts, bs = [], []
            for j in (2 * jp, 2 * jp + 1):
                bs.append(f.v(f"add i64 {b0}, {4 * half + j}"))
                ts.append(wblock(bs[-1]))
            for r in range(nx):
                v = []
                for t, b in zip(ts, bs):
                    acc = "zeroinitializer"
                    for k in range(4):
                        acc = vdp(acc, t[k], xchunk(r, b, k))
                    v.append(acc)
                folded[r].append(_zpair(f, v[0], v[1], 1))
        bh = f.v(f"add i64 {b0}, {4 * half}")
        dw = dw16(bh, 4)
        for r in range(nx):
            u = _zpair(f, folded[r][0], folded[r][1], 2)
            xo = f.v(f"mul i64 %nb, {r}")
            xv = _load_at(f, "<4 x float>", "float", "%xd", f.v(f"add i64 {xo}, {bh}"))
            s = f.v(f"fmul <16 x float> {dw}, {_lanes4(f, 'float', xv, 4)}")
            new[(r, half)] = _fma_isum(f, u, s, accs[(r, half)])
    carried = [(accs[key], "<16 x float>", "zeroinitializer", new[key]) for key in accs]
    _loop_back(f, "%g", "%gnext", "%ngroups", "grp", "rowloop", "gdone", phi_at, carried)
    f("gdone:")
    for key in accs:
        f(f"  {accs[key]}_end = phi <16 x float> [zeroinitializer, %rowloop], [{new[key]}, %grp]")
    f("  br i1 %hastail, label %tloop, label %fin")
    # ---- the nb % 8 leftover blocks: _block's 8-lane partial sums, lane for lane
    f("tloop:")
    f("  %tb = phi i64 [%gmain, %gdone], [%tbnext, %tloop]")
    taccs = {(r, h): f"%wt{r}_{h}" for r in range(nx) for h in range(2)}
    tphi_at = len(f.lines)
    t = wblock("%tb")
    dwt = dw16("%tb", 1)
    tnew = {}
    for r in range(nx):
        d = [vdp("zeroinitializer", t[k], xchunk(r, "%tb", k)) for k in range(4)]
        # _block's lane i (i < 4) sums pairs i and i + 8: chunks 0 and 2; lanes 4-7: chunks 1 and 3
        plo, phi_ = f.v(f"add <16 x i32> {d[0]}, {d[2]}"), f.v(f"add <16 x i32> {d[1]}, {d[3]}")
        xo = f.v(f"add i64 {f.v(f'mul i64 %nb, {r}')}, %tb")
        dx = _load_at(f, "float", "float", "%xd", xo)
        s = f.v(f"fmul <16 x float> {dwt}, {_splat(f, 'float', 16, dx)}")
        for h, pv in enumerate((plo, phi_)):
            tnew[(r, h)] = _fma_isum(f, pv, s, taccs[(r, h)])
    carried = [(taccs[key], "<16 x float>", "zeroinitializer", tnew[key]) for key in taccs]
    _loop_back(f, "%tb", "%tbnext", "%nb", "tloop", "gdone", "fin", tphi_at, carried)
    f("fin:")
    tend = {key: f.v(f"phi <16 x float> [zeroinitializer, %gdone], [{tnew[key]}, %tloop]") for key in taccs}

    for r in range(nx):
        h = f.v(
            f"fadd <16 x float> {_hsum_lanes(f, accs[(r, 0)] + '_end', accs[(r, 1)] + '_end')}, {_hsum_lanes(f, tend[(r, 0)], tend[(r, 1)])}"
        )
        for w in range(4):
            oo = f.v(f"add i64 {f.v(f'mul i64 %ostride, {r}')}, %wrow{w}")
            f(
                f"  store float {f.v(f'extractelement <16 x float> {h}, i32 {4 * w}')}, float* {f.v(f'getelementptr float, float* %out, i64 {oo}')}, align 4"
            )
    f("  br label %rowend")
    f("rowend:")
    f("  %rownext = add i64 %row, 4")
    f("  %rdone = icmp eq i64 %rownext, %r4")
    f("  br i1 %rdone, label %rest, label %rowloop")
    f("rest:")
    f("  %hasrest = icmp slt i64 %r4, %r1")
    f("  br i1 %hasrest, label %callrest, label %exit")
    f("callrest:")
    rest_args = _CALL_ARGS.replace("i64 %r0,", "i64 %r4,")
    f(f"  call void @{name}_rows{nx}({rest_args})")
    f("  br label %exit")
    f("exit:")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


def _zmm_bodies(kind: str, act: int) -> dict[int, tuple[str, object]]:
    """``kind``'s 512-bit bodies on ``act``-bit activations by the input rows they take:
    (name suffix, builder of (kind, act, rows)); the other row counts keep the per-row
    bodies. 3 and 4 rows: ``_zbody`` (``ZBODIES``), ``_wbody`` (``WROWS_KINDS``); 1 and
    2 rows: ``_pbody`` (``ZBODIES``), ``_kpbody`` (``KPBODIES``)."""
    key = (kind, act)
    big = range(ZROWS_FROM, ZROWS + 1)
    small = range(1, PROWS + 1)
    if key in ZBODIES:
        return {**{n: ("z", _zbody) for n in big}, **{n: ("p", _pbody) for n in small}}
    if key in WROWS_KINDS:
        return {n: ("w", _wbody) for n in big}
    if key in KPBODIES:
        return {n: ("k", _kpbody) for n in small}
    return {}


def _dispatch(kind: str, act: int = 8, zmm: bool = False) -> str:
    """The exported entry: a switch on the number of input rows (``zmm``: the
    ``_zmm_bodies`` where ``kind`` has them)."""
    name = _entry(kind, act)
    bodies = _zmm_bodies(kind, act) if zmm else {}
    attrs = _ZMM_ATTR if bodies else ""
    L = [f"define void @{name}_rows(i64 %nx, {_ARGS}) nounwind{attrs} {{", "entry:"]
    cases = " ".join(f"i64 {n}, label %n{n}" for n in range(1, MAX_ROWS + 1))
    L.append(f"  switch i64 %nx, label %done [{cases}]")
    for n in range(1, MAX_ROWS + 1):
        suffix = bodies[n][0] if n in bodies else ""
        body = f"{name}_rows{n}{suffix}"
        L += [f"n{n}:", f"  call void @{body}({_CALL_ARGS})", "  br label %done"]
    L += ["done:", "  ret void", "}"]
    return "\n".join(L)


def module_ir(kind: str | None = None, act: int | None = None, vnni: bool = False, zmm: bool = False) -> str:
    """LLVM IR of the entries for ``kind`` (a ``WIDTHS`` key) and ``act`` (8|16), default
    all; ``vnni``: the dot products as VNNI instructions (the host must have them);
    ``zmm``: 3- and 4-row calls of the ``ZBODIES`` and ``WROWS_KINDS``, 1- and 2-row
    calls of the ``ZBODIES`` and ``KPBODIES`` take the AVX-512 bodies."""
    kinds = (kind,) if kind else tuple(WIDTHS)
    parts = [_DECLS, _DECLS_Z if zmm else ""]
    if any(ops_for(k).kgrid for k in kinds):
        parts.append(_DECL_GRID)
    for k in kinds:
        for bits in (act,) if act else WIDTHS[k]:
            if bits not in WIDTHS[k]:
                raise ValueError(f"no {bits}-bit activation kernel for {k}")
            body = _kbody if ops_for(k).kbody else _gbody
            parts += [body(k, n, bits, vnni) for n in range(1, MAX_ROWS + 1)]
            if zmm:
                parts += [build(k, bits, n) for n, (_, build) in _zmm_bodies(k, bits).items()]
            parts.append(_dispatch(k, bits, zmm))
    return "\n".join(parts)


# The IR entries' signature, every pointer passed as an i64 address (the x86-64 ABI
# passes both in the same registers): numba then calls the kernel by address
# (``_call_rows``), where a ctypes function argument cost a ctypes cast per call.
_ENTRY_ARGS = 17


@intrinsic
def _call_rows(typingctx, addr, nx, p0, p1, p2, p3, p4, r0, r1, nb, xq, xd, xs, out, ostride, xt, xdt, xst):
    """Call the compiled ``*_rows`` entry at ``addr`` (every argument an int64)."""
    sig = types.void(*([types.int64] * (_ENTRY_ARGS + 1)))

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64] * _ENTRY_ARGS)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fn, args[1:])
        return context.get_dummy_value()

    return sig, codegen


def host_supports() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    return all(feats.get(f, False) for f in NEEDED_FEATURES)


def host_vnni() -> bool:
    """The host has 256-bit VNNI dot products (AVX512-VNNI with VL, or AVX-VNNI)."""
    if not host_supports():
        return False
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    return bool(feats.get("avxvnni", False) or (feats.get("avx512vnni", False) and feats.get("avx512vl", False)))


def host_zmm() -> bool:
    """The host has 512-bit VNNI dot products (AVX512-F, BW and VNNI): the 4-row bodies."""
    if not host_vnni():
        return False
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    return all(feats.get(f, False) for f in ZFEATURES)


class IntDot:
    """The compiled integer kernels of one kernel set, each entry JIT-compiled for
    this CPU on first use (0.1-0.5 s per entry: a q8 model compiles only q8's; later
    processes load the object code from ``llvm_jit``'s cache).
    ``vnni`` (default: the host has it) selects the VNNI dot products; both give the
    same integers, so the same results bit for bit. ``zmm`` (default: the host has
    AVX-512 VNNI; needs ``vnni``) gives 3- and 4-row calls the 4-row bodies, whose
    results are the per-row bodies' bit for bit."""

    def __init__(
        self, vnni: bool | None = None, zmm: bool | None = None, cache_dir: Path | None | str = "default"
    ) -> None:
        # The object cache of the compiled entries (llvm_jit.py; None: none).
        self.cache_dir = llvm_jit.default_cache_dir() if cache_dir == "default" else cache_dir
        self.vnni = host_vnni() if vnni is None else bool(vnni)
        if self.vnni and not host_vnni():
            raise ValueError("this CPU has no VNNI dot products")
        self.zmm = (self.vnni and host_zmm()) if zmm is None else bool(zmm)
        if self.zmm and not (self.vnni and host_zmm()):
            raise ValueError("the 4-row bodies need AVX-512 VNNI (and vnni=True)")
        self._lock = threading.Lock()
        self._fns: dict[tuple[str, int, bool], object] = {}  # (kind, act, zmm) -> entry address
        self._engines: list[object] = []  # the machine code lives as long as its engine

    def fn(self, kind: str, act: int, zmm: bool | None = None):
        """The entry of ``kind`` on ``act``-bit activations; ``zmm`` False: the per-row
        bodies only (default: ``self.zmm``)."""
        z = self.zmm if zmm is None else (bool(zmm) and self.zmm)
        key = (kind, act, z)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        with self._lock:
            if key not in self._fns:
                name = f"{_entry(kind, act)}_rows"
                compiled = llvm_jit.compile_ir(module_ir(kind, act, self.vnni, z), [name], self.cache_dir)
                self._engines.append(compiled.engine)
                self._fns[key] = compiled.addrs[name]
            return self._fns[key]

    def interleaves(self, kind: str, act: int, zmm: bool | None = None) -> bool:
        """Whether ``fn(kind, act, zmm)`` reads the rows' interleaved copy."""
        z = self.zmm if zmm is None else (bool(zmm) and self.zmm)
        return z and (kind, act) in ZBODIES


def compile_intdot(
    vnni: bool | None = None, zmm: bool | None = None, cache_dir: Path | None | str = "default"
) -> IntDot | None:
    """The integer kernels, or None where x86-64 AVX2/FMA/F16C are missing."""
    return IntDot(vnni, zmm, cache_dir) if host_supports() else None


# ------------------------------------------------------------ numba drivers
# Weight rows per parallel task: small enough to balance 2..16 threads, big enough
# that a task's call overhead (about 0.1 us) disappears against its dot products.
GRAIN = 16


@njit(cache=True, nogil=True)
def interleave_rows(xq, xd, xs, i0, nx, xt, xdt, xst):
    """Rows i0..i0+nx of the quantized activations in the zmm bodies' layout, rows past
    nx zero: xt [nb][chunks][4 rows][chunk] (a 16-byte chunk of each row side by side),
    xdt / xst [nb / 4][4 rows][4 blocks] (the scales of 4 blocks of each row)."""
    n, cols = xq.shape
    nb = cols // QB
    e = xt.shape[3]
    ch = QB // e
    for b in range(nb):
        for k in range(ch):
            for r in range(ZROWS):
                for j in range(e):
                    xt[b, k, r, j] = xq[i0 + r, b * QB + k * e + j] if r < nx else 0
    for g in range(nb // 4):
        for r in range(ZROWS):
            for j in range(4):
                ok = r < nx
                xdt[g, r, j] = xd[i0 + r, 4 * g + j] if ok else np.float32(0.0)
                xst[g, r, j] = xs[i0 + r, 4 * g + j] if ok else np.float32(0.0)


@njit(parallel=True, cache=True)
def intdot(fn, addrs, rows, count, offs, X, proto, qmax, zmm, out):
    """out[i, offs[m] + r] = W_m[r] . X[i] for the first ``count`` fused matrices:
    ``addrs[m, k]`` is the address of part k of matrix m (``int_parts`` order, 0
    where unused), ``rows[m]`` its rows. The plan that built ``addrs`` holds the
    arrays, so the addresses outlive the call. X is quantized here, to the integer
    type of ``proto`` (int8 or int16) and at most ``qmax``: one compiled call per matmul, where a separate
    quantize call and its scratch arrays cost ~5 us of dispatch per matmul (120 per
    SmolLM2 token). ``zmm``: the entry's 3- and 4-row bodies read an interleaved copy
    of each group of rows (``interleave_rows``), made here once per call."""
    n, cols = X.shape
    nb = cols // QB
    xq = np.empty((n, cols), proto.dtype)
    xd = np.empty((n, nb), np.float32)
    xs = np.empty((n, nb), np.float32)
    quantize_rows(X, xq, xd, xs, qmax)
    ngr = (n + MAX_ROWS - 1) // MAX_ROWS
    e = 16 // xq.itemsize
    zt = zmm and n >= ZROWS_FROM
    # interleave_rows writes every element a zmm body reads (missing rows as zeros)
    xt = np.empty((ngr if zt else 0, nb, QB // e, ZROWS, e), proto.dtype)
    xdt = np.empty((ngr if zt else 0, (nb + 3) // 4, ZROWS, 4), np.float32)
    xst = np.empty((ngr if zt else 0, (nb + 3) // 4, ZROWS, 4), np.float32)
    if zt:
        for gi in range(ngr):
            i0 = gi * MAX_ROWS
            nx = min(MAX_ROWS, n - i0)
            if nx >= ZROWS_FROM:
                interleave_rows(xq, xd, xs, i0, nx, xt[gi], xdt[gi], xst[gi])
    width = out.shape[1]
    # One parallel loop over the row chunks of all fused matrices (q|k|v is one wake-up
    # of the thread pool, not three): chunk t belongs to matrix m while t < first[m + 1].
    first = np.empty(count + 1, np.int64)
    first[0] = 0
    for m in range(count):
        first[m + 1] = first[m] + (rows[m] + GRAIN - 1) // GRAIN
    for t in prange(first[count]):
        m = 0
        while t >= first[m + 1]:
            m += 1
        base = offs[m]
        r0 = (t - first[m]) * GRAIN
        r1 = min(rows[m], r0 + GRAIN)
        for i0 in range(0, n, MAX_ROWS):
            nx = min(MAX_ROWS, n - i0)
            gi = i0 // MAX_ROWS
            zaddr = np.int64(xt.ctypes.data + gi * xt.strides[0]) if zt else np.int64(0)
            zdaddr = np.int64(xdt.ctypes.data + gi * xdt.strides[0]) if zt else np.int64(0)
            zsaddr = np.int64(xst.ctypes.data + gi * xst.strides[0]) if zt else np.int64(0)
            _call_rows(
                fn,
                np.int64(nx),
                addrs[m, 0],
                addrs[m, 1],
                addrs[m, 2],
                addrs[m, 3],
                addrs[m, 4],
                np.int64(r0),
                np.int64(r1),
                np.int64(nb),
                np.int64(xq.ctypes.data + i0 * xq.strides[0]),
                np.int64(xd.ctypes.data + 4 * i0 * nb),
                np.int64(xs.ctypes.data + 4 * i0 * nb),
                np.int64(out.ctypes.data + 4 * (i0 * width + base)),
                np.int64(width),
                zaddr,
                zdaddr,
                zsaddr,
            )
