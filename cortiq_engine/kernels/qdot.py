"""Integer dot products for quantized weights: decode and verify on int8 activations.

ggml's idea (``vec_dot_type``): quantize each input row once per call to int8 in
blocks of 32 (one f32 scale per block), then multiply a weight block by it in
integers. AVX2 does 32 int8 products per instruction (``vpmaddubsw``), where the
float kernels in ``jit.py`` convert every weight to f32 first; measured on one
core, a 1536x576 q8 matvec takes 72 us here against 288 us for the float kernel.

numba does not produce ``vpmaddubsw`` from Python loops (integer dot loops measured
3-10x slower than the float kernel), so the inner loops are written once in LLVM IR
(generated below, one body per number of input rows so the accumulators stay in
registers), compiled with llvmlite for the host CPU, and called from numba's
parallel loops through a function pointer. Hosts without AVX2/FMA/F16C use the
float kernels; ``qdot_ref`` is the numpy twin the tests hold both against.

Per weight row and input row the result is
    sum_b  d_w[b] * d_x[b] * sum_j q_w[b, j] * q_x[b, j]      (q8)
    sum_b  d_w[b] * d_x[b] * sum_j q_w[b, j] * q_x[b, j] + m_w[b] * s_x[b]   (q4: Q4_1 layout)
with s_x[b] = d_x[b] * sum_j q_x[b, j]. The block sums are exact integers and the
float accumulation order of one input row never depends on the others, so a row's
result in a k-row call is bit for bit its result in a 1-row call (the speculative
verify relies on this).
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

QB = 32
# Input rows one IR call handles with all accumulators in registers (AVX2 has 16).
MAX_ROWS = 8
# Weight rows ahead whose block is prefetched (the CPU's prefetcher stops at pages).
PREFETCH_ROWS = 8
NEEDED_FEATURES = ("avx2", "fma", "f16c")


# ------------------------------------------------------------ activations
@njit(cache=True, nogil=True)
def quantize_rows(X, xq, xd, xs):
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
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s = 0
            for j in range(QB):
                q = np.int32(np.rint(X[i, o + j] * inv))
                xq[i, o + j] = q
                s += q
            xd[i, b] = d
            xs[i, b] = d * np.float32(s)


def quantize_rows_ref(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy twin of ``quantize_rows``."""
    n, cols = X.shape
    b = X.reshape(n, cols // QB, QB).astype(np.float32)
    d = np.abs(b).max(axis=2) / np.float32(127.0)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[:, :, None]).astype(np.int8)
    s = (d * q.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(n, cols), d, s


def qdot_ref(dtype: str, parts: tuple[np.ndarray, ...], X: np.ndarray) -> np.ndarray:
    """float64 reference of the integer kernels: [n, rows] for X f32[n, cols]."""
    xq, xd, xs = quantize_rows_ref(X)
    n, cols = X.shape
    nb = cols // QB
    xb = xq.reshape(n, nb, QB).astype(np.float64)
    if dtype == "q8":
        d, qs = parts
        rows = qs.shape[0]
        wb = qs.reshape(rows, nb, QB).astype(np.float64)
        isum = np.einsum("rbk,nbk->nrb", wb, xb)
        return np.einsum("nrb,rb,nb->nr", isum, d.view(np.float16).astype(np.float64), xd.astype(np.float64))
    d, m, qs = parts
    rows = qs.shape[0]
    p = qs.reshape(rows, nb, QB // 2)
    wb = np.concatenate([p & 15, p >> 4], axis=2).astype(np.float64)
    isum = np.einsum("rbk,nbk->nrb", wb, xb)
    dw = d.view(np.float16).astype(np.float64)
    mw = m.view(np.float16).astype(np.float64)
    return np.einsum("nrb,rb,nb->nr", isum, dw, xd.astype(np.float64)) + np.einsum("rb,nb->nr", mw, xs.astype(np.float64))


# ------------------------------------------------------------ LLVM IR
_DECLS = """
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fma.f32(float, float, float)
declare void @llvm.prefetch.p0i8(i8*, i32, i32, i32)
"""
_ONES16 = "<" + ", ".join(["i16 1"] * 16) + ">"
# The signature both dtypes share (q4 passes its mins as ``wm`` and ``xs``):
#   (nx, wq, wd, wm, r0, r1, nb, xq, xd, xs, out, ostride)
# out[i * ostride + r] for input rows i < nx and weight rows r0 <= r < r1.
_ARGS = "i8* %wq, i16* %wd, i16* %wm, i64 %r0, i64 %r1, i64 %nb, i8* %xq, float* %xd, float* %xs, float* %out, i64 %ostride"


def _body(kind: str, nx: int) -> str:
    """One specialized function: ``nx`` input rows, accumulators in registers."""
    q4 = kind == "q4"
    wbytes = 16 if q4 else 32  # weight bytes per block
    L: list[str] = []
    a = L.append
    a(f"define internal void @{kind}_rows{nx}({_ARGS}) nounwind alwaysinline {{")
    a("entry:")
    a("  %cols = mul i64 %nb, 32")
    a(f"  %wrow_bytes = mul i64 %nb, {wbytes}")
    a(f"  %pf_ahead = mul i64 %wrow_bytes, {PREFETCH_ROWS}")
    a("  %empty = icmp sge i64 %r0, %r1")
    a("  br i1 %empty, label %exit, label %rowloop")
    a("rowloop:")
    a("  %row = phi i64 [%r0, %entry], [%rownext, %rowend]")
    a("  %wqrow = mul i64 %row, %wrow_bytes")
    a("  %wdrow = mul i64 %row, %nb")
    a("  br label %blk")
    a("blk:")
    a("  %b = phi i64 [0, %rowloop], [%bnext, %blk]")
    for r in range(nx):
        a(f"  %acc{r} = phi <8 x float> [zeroinitializer, %rowloop], [%accn{r}, %blk]")
        if q4:
            a(f"  %macc{r} = phi float [0.0, %rowloop], [%maccn{r}, %blk]")
    a(f"  %bw = mul i64 %b, {wbytes}")
    a("  %wo = add i64 %wqrow, %bw")
    a("  %wp = getelementptr i8, i8* %wq, i64 %wo")
    a("  %pfp = getelementptr i8, i8* %wp, i64 %pf_ahead")
    a("  call void @llvm.prefetch.p0i8(i8* %pfp, i32 0, i32 3, i32 1)")
    if q4:
        a("  %wpv = bitcast i8* %wp to <16 x i8>*")
        a("  %wpk = load <16 x i8>, <16 x i8>* %wpv, align 1")
        a("  %wlo = and <16 x i8> %wpk, " + "<" + ", ".join(["i8 15"] * 16) + ">")
        a("  %whi = lshr <16 x i8> %wpk, " + "<" + ", ".join(["i8 4"] * 16) + ">")
        a("  %w = shufflevector <16 x i8> %wlo, <16 x i8> %whi, <32 x i32> <" + ", ".join(f"i32 {k}" for k in range(32)) + ">")
    else:
        a("  %wpv = bitcast i8* %wp to <32 x i8>*")
        a("  %w = load <32 x i8>, <32 x i8>* %wpv, align 1")
        # maddubs takes one unsigned operand: |w|, and x carries w's sign (ggml's trick).
        a("  %aw = call <32 x i8> @llvm.abs.v32i8(<32 x i8> %w, i1 false)")
    a("  %wdo = add i64 %wdrow, %b")
    a("  %wdp = getelementptr i16, i16* %wd, i64 %wdo")
    a("  %wdph = bitcast i16* %wdp to half*")
    a("  %wdh = load half, half* %wdph, align 2")
    a("  %dw = fpext half %wdh to float")
    if q4:
        a("  %wmp = getelementptr i16, i16* %wm, i64 %wdo")
        a("  %wmph = bitcast i16* %wmp to half*")
        a("  %wmh = load half, half* %wmph, align 2")
        a("  %mw = fpext half %wmh to float")
    a("  %xb = mul i64 %b, 32")
    for r in range(nx):
        a(f"  %xrow{r} = mul i64 %cols, {r}")
        a(f"  %xo{r} = add i64 %xrow{r}, %xb")
        a(f"  %xp{r} = getelementptr i8, i8* %xq, i64 %xo{r}")
        a(f"  %xpv{r} = bitcast i8* %xp{r} to <32 x i8>*")
        a(f"  %x{r} = load <32 x i8>, <32 x i8>* %xpv{r}, align 1")
        if q4:
            a(f"  %p16{r} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> %w, <32 x i8> %x{r})")
        else:
            a(f"  %sx{r} = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> %x{r}, <32 x i8> %w)")
            a(f"  %p16{r} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> %aw, <32 x i8> %sx{r})")
        a(f"  %p32{r} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %p16{r}, <16 x i16> {_ONES16})")
        a(f"  %pf{r} = sitofp <8 x i32> %p32{r} to <8 x float>")
        a(f"  %xdrow{r} = mul i64 %nb, {r}")
        a(f"  %xdo{r} = add i64 %xdrow{r}, %b")
        a(f"  %xdp{r} = getelementptr float, float* %xd, i64 %xdo{r}")
        a(f"  %dx{r} = load float, float* %xdp{r}, align 4")
        a(f"  %s{r} = fmul float %dw, %dx{r}")
        a(f"  %sv{r}0 = insertelement <8 x float> undef, float %s{r}, i32 0")
        a(f"  %sv{r} = shufflevector <8 x float> %sv{r}0, <8 x float> undef, <8 x i32> zeroinitializer")
        a(f"  %accn{r} = call <8 x float> @llvm.fma.v8f32(<8 x float> %pf{r}, <8 x float> %sv{r}, <8 x float> %acc{r})")
        if q4:
            a(f"  %xsp{r} = getelementptr float, float* %xs, i64 %xdo{r}")
            a(f"  %sx{r} = load float, float* %xsp{r}, align 4")
            a(f"  %maccn{r} = call float @llvm.fma.f32(float %mw, float %sx{r}, float %macc{r})")
    a("  %bnext = add i64 %b, 1")
    a("  %done = icmp eq i64 %bnext, %nb")
    a("  br i1 %done, label %rowend, label %blk")
    a("rowend:")
    for r in range(nx):
        # The horizontal sum in one fixed order.
        a(f"  %h{r}a = shufflevector <8 x float> %accn{r}, <8 x float> undef, <4 x i32> <i32 0, i32 1, i32 2, i32 3>")
        a(f"  %h{r}b = shufflevector <8 x float> %accn{r}, <8 x float> undef, <4 x i32> <i32 4, i32 5, i32 6, i32 7>")
        a(f"  %h{r}c = fadd <4 x float> %h{r}a, %h{r}b")
        a(f"  %h{r}d = shufflevector <4 x float> %h{r}c, <4 x float> undef, <2 x i32> <i32 0, i32 1>")
        a(f"  %h{r}e = shufflevector <4 x float> %h{r}c, <4 x float> undef, <2 x i32> <i32 2, i32 3>")
        a(f"  %h{r}f = fadd <2 x float> %h{r}d, %h{r}e")
        a(f"  %h{r}g = extractelement <2 x float> %h{r}f, i32 0")
        a(f"  %h{r}h = extractelement <2 x float> %h{r}f, i32 1")
        a(f"  %h{r}i = fadd float %h{r}g, %h{r}h")
        a(f"  %h{r} = fadd float %h{r}i, %maccn{r}" if q4 else f"  %h{r} = fadd float %h{r}i, 0.0")
        a(f"  %oo{r}r = mul i64 %ostride, {r}")
        a(f"  %oo{r} = add i64 %oo{r}r, %row")
        a(f"  %op{r} = getelementptr float, float* %out, i64 %oo{r}")
        a(f"  store float %h{r}, float* %op{r}, align 4")
    a("  %rownext = add i64 %row, 1")
    a("  %rdone = icmp eq i64 %rownext, %r1")
    a("  br i1 %rdone, label %exit, label %rowloop")
    a("exit:")
    a("  ret void")
    a("}")
    return "\n".join(L)


def _dispatch(kind: str) -> str:
    """The exported entry: a switch on the number of input rows."""
    L = [f"define void @{kind}_rows(i64 %nx, {_ARGS}) nounwind {{", "entry:"]
    cases = " ".join(f"i64 {n}, label %n{n}" for n in range(1, MAX_ROWS + 1))
    L.append(f"  switch i64 %nx, label %done [{cases}]")
    args = "i8* %wq, i16* %wd, i16* %wm, i64 %r0, i64 %r1, i64 %nb, i8* %xq, float* %xd, float* %xs, float* %out, i64 %ostride"
    for n in range(1, MAX_ROWS + 1):
        L += [f"n{n}:", f"  call void @{kind}_rows{n}({args})", "  br label %done"]
    L += ["done:", "  ret void", "}"]
    return "\n".join(L)


def module_ir() -> str:
    parts = [_DECLS]
    for kind in ("q8", "q4"):
        parts += [_body(kind, n) for n in range(1, MAX_ROWS + 1)]
        parts.append(_dispatch(kind))
    return "\n".join(parts)


_FN = ctypes.CFUNCTYPE(
    None, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
)


@dataclass
class IntDot:
    """The compiled q8/q4 integer kernels (kept alive with their LLVM engine)."""

    q8: object
    q4: object
    _engine: object


def host_supports() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    import llvmlite.binding as llvm

    feats = llvm.get_host_cpu_features()
    return all(feats.get(f, False) for f in NEEDED_FEATURES)


def compile_intdot() -> IntDot | None:
    """JIT the kernels for this CPU (about 0.2 s), or None where AVX2/FMA/F16C are missing."""
    if not host_supports():
        return None
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(module_ir())
    mod.verify()
    target = llvm.Target.from_default_triple()
    tm = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    engine = llvm.create_mcjit_compiler(mod, tm)
    engine.finalize_object()
    return IntDot(
        q8=_FN(engine.get_function_address("q8_rows")),
        q4=_FN(engine.get_function_address("q4_rows")),
        _engine=engine,
    )


# ------------------------------------------------------------ numba drivers
# Weight rows per parallel task: small enough to balance 2..16 threads, big enough
# that a task's call overhead (about 0.1 us) disappears against its dot products.
GRAIN = 16


@njit(parallel=True, cache=True)
def intdot_small(fn, ds, ms, qss, count, offs, xq, xd, xs, out):
    """out[i, offs[m] + r] = W_m[r] . X[i] for the first ``count`` fused matrices;
    ``ms`` are the q4 mins (q8 passes its scales again, unused)."""
    n = xq.shape[0]
    nb = xd.shape[1]
    width = out.shape[1]
    for m in range(count):
        d = ds[m]
        mn = ms[m]
        q = qss[m]
        rows = q.shape[0]
        base = offs[m]
        nchunk = (rows + GRAIN - 1) // GRAIN
        for c in prange(nchunk):
            r0 = c * GRAIN
            r1 = min(rows, r0 + GRAIN)
            for i0 in range(0, n, 8):
                nx = min(8, n - i0)
                fn(
                    nx, q.ctypes.data, d.ctypes.data, mn.ctypes.data, r0, r1, nb,
                    xq.ctypes.data + i0 * xq.shape[1], xd.ctypes.data + 4 * i0 * nb, xs.ctypes.data + 4 * i0 * nb,
                    out.ctypes.data + 4 * (i0 * width + base), width,
                )
