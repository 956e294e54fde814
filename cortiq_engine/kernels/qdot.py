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

Two activation widths (the default kernel set: int16 for q8, int8 for q4):
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
with s_x[b] = d_x[b] * sum_j q_x[b, j]. The block sums are exact integers and the
float accumulation order of one input row never depends on the others, so a row's
result in a k-row call is bit for bit its result in a 1-row call (the speculative
verify relies on this).
"""

from __future__ import annotations

import platform
import threading
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

QB = 32
# Input rows one IR call handles with all accumulators in registers (AVX2 has 16),
# and accumulators per input row.
MAX_ROWS = 4
ACCS = 2
# Weight rows ahead whose block is prefetched (the CPU's prefetcher stops at pages).
PREFETCH_ROWS = 8
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


def quantize_rows_ref(X: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy twin of ``quantize_rows``."""
    n, cols = X.shape
    b = X.reshape(n, cols // QB, QB).astype(np.float32)
    d = np.abs(b).max(axis=2) / np.float32(2 ** (bits - 1) - 1)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[:, :, None]).astype(np.int8 if bits == 8 else np.int16)
    s = (d * q.sum(axis=2, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(n, cols), d, s


def qdot_ref(dtype: str, parts: tuple[np.ndarray, ...], X: np.ndarray, bits: int = 8) -> np.ndarray:
    """float64 reference of the integer kernels: [n, rows] for X f32[n, cols]."""
    xq, xd, xs = quantize_rows_ref(X, bits)
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


def _entry(kind: str, act: int) -> str:
    """The IR name of ``kind``'s kernels on ``act``-bit activations (q8, q8a16, ...)."""
    return kind if act == 8 else f"{kind}a16"


class _Fn:
    """A tiny SSA writer: fresh value names and the lines of one function."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

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


def _block(f: _Fn, kind: str, act: int, nx: int, b: str, accs: list[str], maccs: list[str]) -> tuple[list[str], list[str]]:
    """Multiply weight block ``b`` of the current row by block ``b`` of each input row
    and add it into ``accs[r]`` (and the q4 min term into ``maccs[r]``); the new names."""
    q4 = kind == "q4"
    wbytes = 16 if q4 else 32
    bw = f.v(f"mul i64 {b}, {wbytes}")
    wo = f.v(f"add i64 %wqrow, {bw}")
    wp = f.v(f"getelementptr i8, i8* %wq, i64 {wo}")
    pfp = f.v(f"getelementptr i8, i8* {wp}, i64 %pf_ahead")
    f(f"  call void @llvm.prefetch.p0i8(i8* {pfp}, i32 0, i32 3, i32 1)")
    v16 = "<" + ", ".join(["i8 15"] * 16) + ">"
    v4 = "<" + ", ".join(["i8 4"] * 16) + ">"
    if q4:
        pk = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp} to <16 x i8>*')}, align 1")
        lo, hi = f.v(f"and <16 x i8> {pk}, {v16}"), f.v(f"lshr <16 x i8> {pk}, {v4}")
        if act == 8:
            w = f.v(f"shufflevector <16 x i8> {lo}, <16 x i8> {hi}, <32 x i32> <" + ", ".join(f"i32 {k}" for k in range(32)) + ">")
        else:
            w0, w1 = f.v(f"zext <16 x i8> {lo} to <16 x i16>"), f.v(f"zext <16 x i8> {hi} to <16 x i16>")
    elif act == 8:
        w = f.v(f"load <32 x i8>, <32 x i8>* {f.v(f'bitcast i8* {wp} to <32 x i8>*')}, align 1")
        # maddubs takes one unsigned operand: |w|, and x carries w's sign (ggml's trick).
        aw = f.v(f"call <32 x i8> @llvm.abs.v32i8(<32 x i8> {w}, i1 false)")
    else:
        wp1 = f.v(f"getelementptr i8, i8* {wp}, i64 16")
        l0 = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp} to <16 x i8>*')}, align 1")
        l1 = f.v(f"load <16 x i8>, <16 x i8>* {f.v(f'bitcast i8* {wp1} to <16 x i8>*')}, align 1")
        w0, w1 = f.v(f"sext <16 x i8> {l0} to <16 x i16>"), f.v(f"sext <16 x i8> {l1} to <16 x i16>")
    wdo = f.v(f"add i64 %wdrow, {b}")
    dw = _half(f, "%wd", wdo)
    if q4:
        mw = _half(f, "%wm", wdo)
    xb = f.v(f"mul i64 {b}, 32")
    new_accs, new_maccs = [], []
    for r in range(nx):
        xo = f.v(f"add i64 {f.v(f'mul i64 %cols, {r}')}, {xb}")
        if act == 8:
            x = f.v(f"load <32 x i8>, <32 x i8>* {f.v(f'bitcast i8* ' + f.v(f'getelementptr i8, i8* %xq, i64 {xo}') + ' to <32 x i8>*')}, align 1")
            if q4:
                p16 = f.v(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {w}, <32 x i8> {x})")
            else:
                sx = f.v(f"call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {x}, <32 x i8> {w})")
                p16 = f.v(f"call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {aw}, <32 x i8> {sx})")
            p32 = f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p16}, <16 x i16> {_ONES16})")
        else:
            xp = f.v(f"getelementptr i16, i16* %xq16, i64 {xo}")
            xp1 = f.v(f"getelementptr i16, i16* {xp}, i64 16")
            x0 = f.v(f"load <16 x i16>, <16 x i16>* {f.v(f'bitcast i16* {xp} to <16 x i16>*')}, align 2")
            x1 = f.v(f"load <16 x i16>, <16 x i16>* {f.v(f'bitcast i16* {xp1} to <16 x i16>*')}, align 2")
            p0 = f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {w0}, <16 x i16> {x0})")
            p1 = f.v(f"call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {w1}, <16 x i16> {x1})")
            p32 = f.v(f"add <8 x i32> {p0}, {p1}")
        pf = f.v(f"sitofp <8 x i32> {p32} to <8 x float>")
        xdo = f.v(f"add i64 {f.v(f'mul i64 %nb, {r}')}, {b}")
        dx = f.v(f"load float, float* {f.v(f'getelementptr float, float* %xd, i64 {xdo}')}, align 4")
        sc = f.v(f"fmul float {dw}, {dx}")
        sv = f.v(f"shufflevector <8 x float> {f.v(f'insertelement <8 x float> undef, float {sc}, i32 0')}, <8 x float> undef, <8 x i32> zeroinitializer")
        new_accs.append(f.v(f"call <8 x float> @llvm.fma.v8f32(<8 x float> {pf}, <8 x float> {sv}, <8 x float> {accs[r]})"))
        if q4:
            xsv = f.v(f"load float, float* {f.v(f'getelementptr float, float* %xs, i64 {xdo}')}, align 4")
            new_maccs.append(f.v(f"call float @llvm.fma.f32(float {mw}, float {xsv}, float {maccs[r]})"))
        else:
            new_maccs.append(maccs[r])
    return new_accs, new_maccs


def _body(kind: str, nx: int, act: int = 8) -> str:
    """One specialized function: ``nx`` input rows, ``ACCS`` accumulators per input
    row (block b adds into accumulator b % ACCS: independent FMA chains hide their
    latency; the split depends on b only, so every row sums in the same order
    whatever ``nx`` is)."""
    q4 = kind == "q4"
    A = ACCS
    name = _entry(kind, act)
    f = _Fn()
    zero_v, zero_s = "zeroinitializer", "0.0"
    f(f"define internal void @{name}_rows{nx}({_ARGS}) nounwind alwaysinline {{")
    f("entry:")
    f("  %cols = mul i64 %nb, 32")
    f(f"  %wrow_bytes = mul i64 %nb, {16 if q4 else 32}")
    f(f"  %pf_ahead = mul i64 %wrow_bytes, {PREFETCH_ROWS}")
    f("  %xq16 = bitcast i8* %xq to i16*")
    f(f"  %nbrem = urem i64 %nb, {A}")
    f("  %nbmain = sub i64 %nb, %nbrem")
    f("  %empty = icmp sge i64 %r0, %r1")
    f("  br i1 %empty, label %exit, label %rowloop")
    f("rowloop:")
    f("  %row = phi i64 [%r0, %entry], [%rownext, %rowend]")
    f("  %wqrow = mul i64 %row, %wrow_bytes")
    f("  %wdrow = mul i64 %row, %nb")
    f("  %hasmain = icmp sgt i64 %nbmain, 0")
    f("  br i1 %hasmain, label %blk, label %tail0")
    # main loop: A blocks per iteration
    f("blk:")
    f("  %b = phi i64 [0, %rowloop], [%bnext, %blkend]")
    acc = [[f"%acc{r}_{j}" for j in range(A)] for r in range(nx)]
    macc = [[f"%macc{r}_{j}" for j in range(A)] for r in range(nx)]
    phi_at = len(f.lines)
    cur_a = [row[:] for row in acc]
    cur_m = [row[:] for row in macc]
    for j in range(A):
        bj = f.v(f"add i64 %b, {j}")
        na, nm = _block(f, kind, act, nx, bj, [cur_a[r][j] for r in range(nx)], [cur_m[r][j] for r in range(nx)])
        for r in range(nx):
            cur_a[r][j], cur_m[r][j] = na[r], nm[r]
    f("  br label %blkend")
    f("blkend:")
    f(f"  %bnext = add i64 %b, {A}")
    f("  %more = icmp slt i64 %bnext, %nbmain")
    f("  br i1 %more, label %blk, label %tail0")
    phis = []
    for r in range(nx):
        for j in range(A):
            phis.append(f"  {acc[r][j]} = phi <8 x float> [{zero_v}, %rowloop], [{cur_a[r][j]}, %blkend]")
            if q4:
                phis.append(f"  {macc[r][j]} = phi float [{zero_s}, %rowloop], [{cur_m[r][j]}, %blkend]")
    f.lines[phi_at:phi_at] = phis
    # tail: the nb % A leftover blocks, each into its own accumulator
    inc_a = {"rowloop": [[zero_v] * A for _ in range(nx)], "blkend": [row[:] for row in cur_a]}
    inc_m = {"rowloop": [[zero_s] * A for _ in range(nx)], "blkend": [row[:] for row in cur_m]}
    for t in range(A):
        label = f"tail{t}"
        f(f"{label}:")
        here_a = [[f"%{label}a{r}_{j}" for j in range(A)] for r in range(nx)]
        here_m = [[f"%{label}m{r}_{j}" for j in range(A)] for r in range(nx)]
        for r in range(nx):
            for j in range(A):
                f(f"  {here_a[r][j]} = phi <8 x float> " + ", ".join(f"[{v[r][j]}, %{p}]" for p, v in inc_a.items()))
                if q4:
                    f(f"  {here_m[r][j]} = phi float " + ", ".join(f"[{v[r][j]}, %{p}]" for p, v in inc_m.items()))
                else:
                    here_m[r][j] = zero_s
        if t == A - 1:
            break
        bt = f.v(f"add i64 %nbmain, {t}")
        ct = f.v(f"icmp slt i64 {bt}, %nb")
        f(f"  br i1 {ct}, label %tb{t}, label %tail{t + 1}")
        f(f"tb{t}:")
        na, nm = _block(f, kind, act, nx, bt, [here_a[r][t] for r in range(nx)], [here_m[r][t] for r in range(nx)])
        f(f"  br label %tail{t + 1}")
        new_a = [row[:] for row in here_a]
        new_m = [row[:] for row in here_m]
        for r in range(nx):
            new_a[r][t], new_m[r][t] = na[r], nm[r]
        inc_a = {label: here_a, f"tb{t}": new_a}
        inc_m = {label: here_m, f"tb{t}": new_m}
    # combine in one fixed order and store
    for r in range(nx):
        v = here_a[r][0]
        m = here_m[r][0]
        for j in range(1, A):
            v = f.v(f"fadd <8 x float> {v}, {here_a[r][j]}")
            if q4:
                m = f.v(f"fadd float {m}, {here_m[r][j]}")
        lo = f.v(f"shufflevector <8 x float> {v}, <8 x float> undef, <4 x i32> <i32 0, i32 1, i32 2, i32 3>")
        hi = f.v(f"shufflevector <8 x float> {v}, <8 x float> undef, <4 x i32> <i32 4, i32 5, i32 6, i32 7>")
        c = f.v(f"fadd <4 x float> {lo}, {hi}")
        d = f.v(f"fadd <2 x float> {f.v(f'shufflevector <4 x float> {c}, <4 x float> undef, <2 x i32> <i32 0, i32 1>')}, "
                f"{f.v(f'shufflevector <4 x float> {c}, <4 x float> undef, <2 x i32> <i32 2, i32 3>')}")
        h = f.v(f"fadd float {f.v(f'extractelement <2 x float> {d}, i32 0')}, {f.v(f'extractelement <2 x float> {d}, i32 1')}")
        if q4:
            h = f.v(f"fadd float {h}, {m}")
        oo = f.v(f"add i64 {f.v(f'mul i64 %ostride, {r}')}, %row")
        f(f"  store float {h}, float* {f.v(f'getelementptr float, float* %out, i64 {oo}')}, align 4")
    f("  br label %rowend")
    f("rowend:")
    f("  %rownext = add i64 %row, 1")
    f("  %rdone = icmp eq i64 %rownext, %r1")
    f("  br i1 %rdone, label %exit, label %rowloop")
    f("exit:")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


def _dispatch(kind: str, act: int = 8) -> str:
    """The exported entry: a switch on the number of input rows."""
    name = _entry(kind, act)
    L = [f"define void @{name}_rows(i64 %nx, {_ARGS}) nounwind {{", "entry:"]
    cases = " ".join(f"i64 {n}, label %n{n}" for n in range(1, MAX_ROWS + 1))
    L.append(f"  switch i64 %nx, label %done [{cases}]")
    args = "i8* %wq, i16* %wd, i16* %wm, i64 %r0, i64 %r1, i64 %nb, i8* %xq, float* %xd, float* %xs, float* %out, i64 %ostride"
    for n in range(1, MAX_ROWS + 1):
        L += [f"n{n}:", f"  call void @{name}_rows{n}({args})", "  br label %done"]
    L += ["done:", "  ret void", "}"]
    return "\n".join(L)


def module_ir(kind: str | None = None, act: int | None = None) -> str:
    """LLVM IR of the entries for ``kind`` (q8|q4) and ``act`` (8|16), default all."""
    parts = [_DECLS]
    for k in (kind,) if kind else ("q8", "q4"):
        for bits in (act,) if act else (8, 16):
            parts += [_body(k, n, bits) for n in range(1, MAX_ROWS + 1)]
            parts.append(_dispatch(k, bits))
    return "\n".join(parts)


# The IR entries' signature, every pointer passed as an i64 address (the x86-64 ABI
# passes both in the same registers): numba then calls the kernel by address
# (``_call_rows``), where a ctypes function argument cost a ctypes cast per call.
_ENTRY_ARGS = 12


@intrinsic
def _call_rows(typingctx, addr, nx, wq, wd, wm, r0, r1, nb, xq, xd, xs, out, ostride):
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


class IntDot:
    """The compiled integer kernels of one kernel set, each entry JIT-compiled for
    this CPU on first use (0.1-0.5 s per entry: a q8 model compiles only q8's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[tuple[str, int], object] = {}
        self._engines: list[object] = []  # the machine code lives as long as its engine

    def fn(self, kind: str, act: int):
        key = (kind, act)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        with self._lock:
            if key not in self._fns:
                import llvmlite.binding as llvm

                llvm.initialize_native_target()
                llvm.initialize_native_asmprinter()
                mod = llvm.parse_assembly(module_ir(kind, act))
                mod.verify()
                tm = llvm.Target.from_default_triple().create_target_machine(
                    cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
                )
                engine = llvm.create_mcjit_compiler(mod, tm)
                engine.finalize_object()
                self._engines.append(engine)
                self._fns[key] = int(engine.get_function_address(f"{_entry(kind, act)}_rows"))
            return self._fns[key]


def compile_intdot() -> IntDot | None:
    """The integer kernels, or None where x86-64 AVX2/FMA/F16C are missing."""
    return IntDot() if host_supports() else None


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
            for i0 in range(0, n, MAX_ROWS):
                nx = min(MAX_ROWS, n - i0)
                _call_rows(
                    fn, np.int64(nx), np.int64(q.ctypes.data), np.int64(d.ctypes.data), np.int64(mn.ctypes.data),
                    np.int64(r0), np.int64(r1), np.int64(nb), np.int64(xq.ctypes.data + i0 * xq.strides[0]),
                    np.int64(xd.ctypes.data + 4 * i0 * nb), np.int64(xs.ctypes.data + 4 * i0 * nb),
                    np.int64(out.ctypes.data + 4 * (i0 * width + base)), np.int64(width),
                )
