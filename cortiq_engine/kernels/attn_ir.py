"""The two inner loops of decode and verify attention, in LLVM IR.

``jit.attend`` splits a query's keys into chunks (split-K) and, per chunk and head,
needs the scores ``s[j] = scale * q . k_j`` and the weighted value sum
``o = sum_j p[j] v_j``. numba compiles both Python loops to mostly scalar code
(``vfmadd231ss``: 4-6 multiply-adds per cycle; a decode at 2,048 tokens of context
spent a third of its step in attention on TinyLlama's shape), so they are written
here with explicit 16-lane vectors, compiled once for the host by llvmlite and
called from ``jit.attend`` by address (``call_scores``, ``call_values``):

- ``attn_scores``: four keys per pass, each with its own accumulator over the
  head dimension in chunks of 16, then one horizontal sum per key.
- ``attn_values``: per chunk of 16 value columns, eight accumulators over the keys
  (key j into accumulator j mod 8, the leftover keys into the first), added in a
  fixed tree.

Both need the head dimensions to be multiples of 16 (``fits``); others keep the
numba loops. How many heads and keys one pass holds in registers is the host's
``Layout`` (``host_layout``): AVX2's 16 ymm registers take half the accumulators
AVX-512's 32 do. Every operation's order depends only on the chunk's own keys, never on
how many queries share the call: a row stays bit for bit its one-row result (the
speculative verify relies on it). ``attend_ref`` in the tests holds them against
float64 math.

A prefill (``jit.attend_flash``) has many queries per key: there scores and weighted
values are two small matrix products per block of queries and keys, and
``attn_gemm`` computes them (C = A B, or C += A B) with GEMM_ROWS rows of A against 16
columns of B in registers, one broadcast of A and one load of B per multiply-add
column: 42 GMAC/s on one Zen 3 core where the per-query loops above reach 23.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from cortiq_engine.kernels import llvm_jit

LANES = 16
# Heads one call serves (a KV head's query group; larger groups take several calls).
MAX_GROUP = 8


@dataclass(frozen=True)
class Layout:
    """How many 16-lane accumulators a pass keeps in registers. ``heads``: heads per
    pass (``attn_scores``/``attn_values`` split a larger group into passes of this many);
    ``chains``: accumulators per pass, keys per pass = max(1, chains // heads), so a small
    group still covers the multiply-add latency on two FMA ports; ``min_keys``: keys per pass
    at least. With 32 vector registers (AVX-512) 8 x 8 fit, and a group of 5-8 takes two
    keys a pass (16 accumulators), which halves its reloads of the query rows (TinyLlama's
    shape at 2,048 keys, 22 layers' caches from memory, Zen 5: 1.09x); with AVX2's 16 ymm a
    16-lane accumulator takes two, and 8 of them
    filled the register file: LLVM shuffled and spilled them every pass (30 moves per 16
    multiply-adds in attn_scores8), and a decode's attention at 2,048 tokens of context
    on TinyLlama's shape (group 8) ran at 12 GMAC/s on one core."""

    heads: int
    chains: int
    min_keys: int = 1

    def keys_per_pass(self, g: int) -> int:
        return max(self.min_keys, self.chains // g)


WIDE = Layout(heads=8, chains=8, min_keys=2)  # 32 vector registers
NARROW = Layout(heads=4, chains=4)  # AVX2: 16 ymm

# Software prefetch distance: key rows a fixed 4 KB ahead (the hardware's streams
# stop at each page); value rows PREFETCH_ROWS rows ahead in each column pass.
PREFETCH_BYTES = 4096
PREFETCH_ROWS = 16
# Cache lines of the row ahead each value pass prefetches: a pass reads one 16-lane column
# of every row, so one line a row left each later pass to miss its own line again (a
# decode at 2,048 keys from memory moved ~10 GB/s a thread). Two lines a pass, with two
# keys a pass (``WIDE``): TinyLlama's shape at 2,048 keys, 22 layers' caches from memory,
# 2 threads, alternating in one process (Zen 5, two runs): f32 1.21-1.55x (4.20 -> 3.42 ms
# a step), f16 1.13-1.28x (3.14 -> 2.80); four lines measured the same.
VALUE_LINES = 2

# The KV cache's element types (``cache.KV_DTYPES``) as LLVM types, and their sizes.
KV_ELEMS = {"f32": "float", "f16": "half"}
_BYTES = {"float": 4, "half": 2}

_V = f"<{LANES} x float>"
_DECLS = f"""
declare {_V} @llvm.fma.v16f32({_V}, {_V}, {_V})
declare float @llvm.vector.reduce.fadd.v16f32(float, {_V})
declare void @llvm.prefetch.p0i8(i8*, i32, i32, i32)
declare {_V} @llvm.maxnum.v16f32({_V}, {_V})
declare {_V} @llvm.floor.v16f32({_V})
declare float @llvm.vector.reduce.fmax.v16f32({_V})
declare {_V} @llvm.masked.load.v16f32.p0v16f32({_V}*, i32, <{LANES} x i1>, {_V})
declare void @llvm.masked.store.v16f32.p0v16f32({_V}, {_V}*, i32, <{LANES} x i1>)
"""


# The entries' arguments (pointers as i64 addresses; s/p and o rows ``ss``/``ps``/``os`` floats apart).
_SARGS = "i64 %qa, i64 %ka, i64 %m, i64 %d, float %scale, i64 %sa, i64 %ss"
_VARGS = "i64 %pa, i64 %va, i64 %m, i64 %dv, i64 %oa, i64 %ps, i64 %os"


class _Ir:
    """Lines of one function and fresh value names."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def __call__(self, text: str) -> None:
        self.lines.append(text)

    def v(self, expr: str) -> str:
        self.n += 1
        self.lines.append(f"  %v{self.n} = {expr}")
        return f"%v{self.n}"

    def load(self, base: str, index: str, elem: str = "float") -> str:
        """16 lanes from ``base[index]``; ``elem`` "half": f16 widened to f32 (F16C's
        vcvtph2ps, exact)."""
        ptr = self.v(f"getelementptr {elem}, {elem}* {base}, i64 {index}")
        vt = f"<{LANES} x {elem}>"
        x = self.v(f"load {vt}, {vt}* {self.v(f'bitcast {elem}* {ptr} to {vt}*')}, align {_BYTES[elem]}")
        return x if elem == "float" else self.v(f"fpext {vt} {x} to {_V}")

    def prefetch(self, base: str, index: str, elem: str = "float") -> None:
        ptr = self.v(f"getelementptr {elem}, {elem}* {base}, i64 {index}")
        self(f"  call void @llvm.prefetch.p0i8(i8* {self.v(f'bitcast {elem}* {ptr} to i8*')}, i32 0, i32 3, i32 1)")

    def splat_i32(self, scalar: str) -> str:
        one = self.v(f"insertelement <{LANES} x i32> undef, i32 {scalar}, i32 0")
        return self.v(f"shufflevector <{LANES} x i32> {one}, <{LANES} x i32> undef, <{LANES} x i32> zeroinitializer")

    def splat(self, scalar: str) -> str:
        one = self.v(f"insertelement {_V} undef, float {scalar}, i32 0")
        return self.v(f"shufflevector {_V} {one}, {_V} undef, <{LANES} x i32> zeroinitializer")

    def fma(self, a: str, b: str, c: str) -> str:
        return self.v(f"call {_V} @llvm.fma.v16f32({_V} {a}, {_V} {b}, {_V} {c})")

    def shuffle(self, a: str, b: str, idx: list[int]) -> str:
        mask = "<" + ", ".join(f"i32 {i}" for i in idx) + ">"
        return self.v(f"shufflevector {_V} {a}, {_V} {b}, <{LANES} x i32> {mask}")

    def reduce_many(self, vecs: list[str]) -> list[str]:
        """The lane sums of up to 16 vectors, in a fixed order. Pairs of vectors fold
        into one (each item's partial lanes halve: two shuffles and an add serve two
        items), then the last vector's items fold in place: 2-3 operations per item
        where one horizontal sum per vector costs 8."""
        n = 1
        while n < len(vecs):
            n *= 2
        assert n <= LANES
        level = list(vecs) + ["zeroinitializer"] * (n - len(vecs))
        width = LANES  # partial lanes per item
        while len(level) > 1:
            items, half = LANES // width, width // 2
            lo = [k + p * width + i for k in (0, LANES) for p in range(items) for i in range(half)]
            hi = [x + half for x in lo]
            level = [
                self.v(f"fadd {_V} {self.shuffle(a, b, lo)}, {self.shuffle(a, b, hi)}")
                for a, b in zip(level[::2], level[1::2])
            ]
            width = half
        v = level[0]
        while width > 1:
            half = width // 2
            v = self.v(f"fadd {_V} {v}, {self.shuffle(v, v, [(i + half) % LANES for i in range(LANES)])}")
            width = half
        step = LANES // n
        return [self.v(f"extractelement {_V} {v}, i32 {k * step}") for k in range(len(vecs))]

    def tree(self, xs: list[str]) -> str:
        """Pairwise sums in a fixed order: ((0+1)+(2+3))+..."""
        while len(xs) > 1:
            nxt = [self.v(f"fadd {_V} {a}, {b}") for a, b in zip(xs[::2], xs[1::2])]
            xs = nxt + ([xs[-1]] if len(xs) % 2 else [])
        return xs[0]


def _scores_pass(f: _Ir, g: int, nk: int, tag: str, first: str, limit: str, entry: str, out: str, kv: str) -> None:
    """Keys j = first, first+nk, ... < limit, nk per pass (limit - first a multiple of
    nk): per head and key an accumulator over the chunks of 16, one horizontal sum each."""
    f(f"  %{tag}_any = icmp slt i64 {first}, {limit}")
    f(f"  br i1 %{tag}_any, label %{tag}, label %{out}")
    f(f"{tag}:")
    j = f"%{tag}_j"
    f(f"  {j} = phi i64 [{first}, %{entry}], [%{tag}_jn, %{tag}_end]")
    f(f"  br label %{tag}_dims")
    f(f"{tag}_dims:")
    at = len(f.lines)
    c = f"%{tag}_c"
    e = f.v(f"shl i64 {c}, 4")
    kvs = []
    for r in range(nk):
        row = f.v(f"add i64 {j}, {r}")
        ko = f.v(f"add i64 {f.v(f'mul i64 {row}, %d')}, {e}")
        kvs.append(f.load("%k", ko, kv))
        # the cache's rows stream from memory at long context: a fixed distance ahead
        f.prefetch("%k", f.v(f"add i64 {ko}, {PREFETCH_BYTES // _BYTES[kv]}"), kv)
    accs = {}
    for h in range(g):
        qv = f.load("%q", f.v(f"add i64 {f.v(f'mul i64 %d, {h}')}, {e}"))
        for r in range(nk):
            accs[h, r] = f.fma(qv, kvs[r], f"%{tag}_a{h}_{r}")
    f(f"  %{tag}_cn = add i64 {c}, 1")
    f(f"  %{tag}_cm = icmp ult i64 %{tag}_cn, %nc")
    f(f"  br i1 %{tag}_cm, label %{tag}_dims, label %{tag}_end")
    phis = [f"  {c} = phi i64 [0, %{tag}], [%{tag}_cn, %{tag}_dims]"]
    phis += [
        f"  %{tag}_a{h}_{r} = phi {_V} [zeroinitializer, %{tag}], [{accs[h, r]}, %{tag}_dims]"
        for h in range(g)
        for r in range(nk)
    ]
    f.lines[at:at] = phis
    f(f"{tag}_end:")
    items = [(h, r) for h in range(g) for r in range(nk)]
    totals = f.reduce_many([accs[hr] for hr in items])
    for (h, r), tot in zip(items, totals):
        x = f.v(f"fmul float {tot}, %scale")
        idx = f.v(f"add i64 {f.v(f'mul i64 %ss, {h}')}, {f.v(f'add i64 {j}, {r}')}")
        f(f"  store float {x}, float* {f.v(f'getelementptr float, float* %s, i64 {idx}')}, align 4")
    f(f"  %{tag}_jn = add i64 {j}, {nk}")
    f(f"  %{tag}_more = icmp slt i64 %{tag}_jn, {limit}")
    f(f"  br i1 %{tag}_more, label %{tag}, label %{out}")


def _prologue(name: str, args: str, ptrs: tuple[str, ...], dim: str, kp: int, kv: str) -> _Ir:
    """A function's header: its pointers (``%x`` from the argument ``%xa``; keys and
    values of type ``kv``, the rest float), the 16-lane chunks of ``dim`` (``%nc``) and
    the keys in whole passes of ``kp`` (``%mk``)."""
    f = _Ir()
    f(f"define void @{name}({args}) nounwind" + ' "min-legal-vector-width"="512" {')
    f("entry:")
    for p in ptrs:
        f(f"  %{p} = inttoptr i64 %{p}a to {kv if p in ('k', 'v') else 'float'}*")
    f(f"  %nc = lshr i64 {dim}, 4")
    f(f"  %mk = sub i64 %m, {f.v(f'urem i64 %m, {kp}')}")
    return f


def _scores_ir(g: int, kp: int, kv: str = "float") -> str:
    """attn_scores{g}(q, k, m, d, scale, s, sstride): for the g heads h < g and keys j < m,
    s[h*sstride + j] = scale * sum_e q[h*d + e] k[j*d + e]. Each key row is loaded once
    for all g heads (a KV head's group: 8 on TinyLlama's shape), where one head at a
    time re-read the chunk from L2 per head. ``kp`` keys per pass; ``kv`` the keys'
    element type (float, or half: an f16 cache)."""
    f = _prologue(f"attn_scores{g}", _SARGS, ("q", "k", "s"), "%d", kp, kv)
    f("  br label %pre")
    f("pre:")
    _scores_pass(f, g, kp, "kk", "0", "%mk", "pre", "rest", kv)
    f("rest:")
    f("  br label %rest1")
    f("rest1:")
    _scores_pass(f, g, 1, "k1", "%mk", "%m", "rest1", "done", kv)
    f("done:")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


def _values_ir(g: int, kp: int, kv: str = "float") -> str:
    """attn_values{g}(p, v, m, dv, o, pstride, ostride): for the g heads h < g and columns
    e < dv, o[h*ostride + e] = sum_j p[h*pstride + j] v[j*dv + e] (overwritten). Key j
    adds into accumulator j mod kp of its head (the leftover keys into the first); the
    kp accumulators then add in a fixed tree. ``kv``: the values' element type."""
    f = _prologue(f"attn_values{g}", _VARGS, ("p", "v", "o"), "%dv", kp, kv)
    f("  %anyc = icmp ugt i64 %nc, 0")
    f("  br i1 %anyc, label %col, label %done")
    f("col:")
    f("  %c = phi i64 [0, %entry], [%cn, %colend]")
    f("  %e = shl i64 %c, 4")
    f("  %many = icmp slt i64 0, %mk")
    f("  br i1 %many, label %keys, label %sum")
    f("keys:")
    at = len(f.lines)
    new = {}
    for r in range(kp):
        row = f.v(f"add i64 %j, {r}")
        vo = f.v(f"add i64 {f.v(f'mul i64 {row}, %dv')}, %e")
        vv = f.load("%v", vo, kv)
        ahead = f.v(f"add i64 {vo}, {f.v(f'mul i64 %dv, {PREFETCH_ROWS}')}")
        for line in range(VALUE_LINES):  # this pass's line and the next passes' of the row ahead
            f.prefetch("%v", f.v(f"add i64 {ahead}, {line * 64 // _BYTES[kv]}"), kv)
        for h in range(g):
            pidx = f.v(f"add i64 {f.v(f'mul i64 %ps, {h}')}, {row}")
            ps = f.v(f"load float, float* {f.v(f'getelementptr float, float* %p, i64 {pidx}')}, align 4")
            new[h, r] = f.fma(f.splat(ps), vv, f"%a{h}_{r}")
    f(f"  %jn = add i64 %j, {kp}")
    f("  %kmore = icmp slt i64 %jn, %mk")
    f("  br i1 %kmore, label %keys, label %sum")
    phis = ["  %j = phi i64 [0, %col], [%jn, %keys]"]
    phis += [
        f"  %a{h}_{r} = phi {_V} [zeroinitializer, %col], [{new[h, r]}, %keys]" for h in range(g) for r in range(kp)
    ]
    f.lines[at:at] = phis
    f("sum:")
    sums = []
    for h in range(g):
        zs = []
        for r in range(kp):
            f(f"  %z{h}_{r} = phi {_V} [zeroinitializer, %col], [{new[h, r]}, %keys]")
            zs.append(f"%z{h}_{r}")
        sums.append(zs)
    heads = [f.tree(zs) for zs in sums]
    f("  %left = icmp slt i64 %mk, %m")
    f("  br i1 %left, label %tail, label %colend")
    f("tail:")
    at = len(f.lines)
    row = "%t"
    vv = f.load("%v", f.v(f"add i64 {f.v(f'mul i64 {row}, %dv')}, %e"), kv)
    tails = []
    for h in range(g):
        pidx = f.v(f"add i64 {f.v(f'mul i64 %ps, {h}')}, {row}")
        ps = f.v(f"load float, float* {f.v(f'getelementptr float, float* %p, i64 {pidx}')}, align 4")
        tails.append(f.fma(f.splat(ps), vv, f"%ta{h}"))
    f("  %tn = add i64 %t, 1")
    f("  %tmore = icmp slt i64 %tn, %m")
    f("  br i1 %tmore, label %tail, label %colend")
    phis = ["  %t = phi i64 [%mk, %sum], [%tn, %tail]"]
    phis += [f"  %ta{h} = phi {_V} [{heads[h]}, %sum], [{tails[h]}, %tail]" for h in range(g)]
    f.lines[at:at] = phis
    f("colend:")
    for h in range(g):
        f(f"  %res{h} = phi {_V} [{heads[h]}, %sum], [{tails[h]}, %tail]")
    for h in range(g):
        oidx = f.v(f"add i64 {f.v(f'mul i64 %os, {h}')}, %e")
        ptr = f.v(f"getelementptr float, float* %o, i64 {oidx}")
        f(f"  store {_V} %res{h}, {_V}* {f.v(f'bitcast float* {ptr} to {_V}*')}, align 4")
    f("  %cn = add i64 %c, 1")
    f("  %cmore = icmp ult i64 %cn, %nc")
    f("  br i1 %cmore, label %col, label %done")
    f("done:")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


def _exp16(f: _Ir, x: str) -> str:
    """exp(x) for x <= 0 on 16 lanes: ``jit.exp_nonpositive``'s method and constants
    (Cody-Waite reduction, degree-7 Taylor polynomial, 2^k from the exponent bits;
    below -87 the result is exp(-87))."""
    c = lambda value: f.splat(repr(float(np.float32(value))))  # noqa: E731
    v = f.v(f"call {_V} @llvm.maxnum.v16f32({_V} {x}, {_V} {c(-87.0)})")
    k = f.v(f"call {_V} @llvm.floor.v16f32({_V} {f.fma(v, c(1.4426950408889634), c(0.5))})")
    r = f.v(f"fsub {_V} {v}, {f.v(f'fmul {_V} {k}, {c(0.693145751953125)}')}")
    r = f.v(f"fsub {_V} {r}, {f.v(f'fmul {_V} {k}, {c(1.428606765330187e-06)}')}")
    p = c(1.0 / 5040.0)
    for coef in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = f.fma(p, r, c(coef))
    ki = f.v(f"fptosi {_V} {k} to <{LANES} x i32>")
    biased = f.v(f"add <{LANES} x i32> {ki}, {_ivec(127)}")
    bits = f.v(f"shl <{LANES} x i32> {biased}, {_ivec(23)}")
    return f.v(f"fmul {_V} {p}, {f.v(f'bitcast <{LANES} x i32> {bits} to {_V}')}")


def _ivec(value: int) -> str:
    return "<" + ", ".join([f"i32 {value}"] * LANES) + ">"


def _softmax_ir() -> str:
    """attn_softmax(s, m, res): mx = max s[:m]; s[j] = exp(s[j] - mx); res = (mx, sum):
    16 lanes at a time, the last chunk masked; the sum in lane order then a fixed fold."""
    f = _Ir()
    f("define void @attn_softmax(i64 %sa, i64 %m, i64 %ra) nounwind" + ' "min-legal-vector-width"="512" {')
    f("entry:")
    f("  %s = inttoptr i64 %sa to float*")
    f("  %res = inttoptr i64 %ra to float*")
    f("  %nc = lshr i64 %m, 4")
    f("  %left = and i64 %m, 15")
    lanes = "<" + ", ".join(f"i32 {i}" for i in range(LANES)) + ">"
    f(f"  %tailmask = icmp ult <{LANES} x i32> {lanes}, {f.splat_i32(f.v('trunc i64 %left to i32'))}")
    ninf = f.splat("0xFFF0000000000000")
    f("  %tailoff = shl i64 %nc, 4")
    tp = f.v(f"bitcast float* {f.v('getelementptr float, float* %s, i64 %tailoff')} to {_V}*")
    f("  %any = icmp ugt i64 %nc, 0")
    f("  br i1 %any, label %maxl, label %maxt")
    f("maxl:")
    f("  %mi = phi i64 [0, %entry], [%min, %maxl]")
    f(f"  %mv = phi {_V} [{ninf}, %entry], [%mvn, %maxl]")
    x = f.load("%s", f.v("shl i64 %mi, 4"))
    f(f"  %mvn = call {_V} @llvm.maxnum.v16f32({_V} %mv, {_V} {x})")
    f("  %min = add i64 %mi, 1")
    f("  %mmore = icmp ult i64 %min, %nc")
    f("  br i1 %mmore, label %maxl, label %maxt")
    f("maxt:")
    f(f"  %mv2 = phi {_V} [{ninf}, %entry], [%mvn, %maxl]")
    xt = f.v(f"call {_V} @llvm.masked.load.v16f32.p0v16f32({_V}* {tp}, i32 4, <{LANES} x i1> %tailmask, {_V} {ninf})")
    mall = f.v(f"call {_V} @llvm.maxnum.v16f32({_V} %mv2, {_V} {xt})")
    mx = f.v(f"call float @llvm.vector.reduce.fmax.v16f32({_V} {mall})")
    mxv = f.splat(mx)
    f("  br i1 %any, label %expl, label %expt")
    f("expl:")
    f("  %ei = phi i64 [0, %maxt], [%ein, %expl]")
    f(f"  %ev = phi {_V} [zeroinitializer, %maxt], [%evn, %expl]")
    off = f.v("shl i64 %ei, 4")
    y = _exp16(f, f.v(f"fsub {_V} {f.load('%s', off)}, {mxv}"))
    f(
        f"  store {_V} {y}, {_V}* {f.v('bitcast float* ' + f.v(f'getelementptr float, float* %s, i64 {off}') + f' to {_V}*')}, align 4"
    )
    f(f"  %evn = fadd {_V} %ev, {y}")
    f("  %ein = add i64 %ei, 1")
    f("  %emore = icmp ult i64 %ein, %nc")
    f("  br i1 %emore, label %expl, label %expt")
    f("expt:")
    f(f"  %ev2 = phi {_V} [zeroinitializer, %maxt], [%evn, %expl]")
    xt2 = f.v(f"call {_V} @llvm.masked.load.v16f32.p0v16f32({_V}* {tp}, i32 4, <{LANES} x i1> %tailmask, {_V} {mxv})")
    yt = _exp16(f, f.v(f"fsub {_V} {xt2}, {mxv}"))
    f(f"  call void @llvm.masked.store.v16f32.p0v16f32({_V} {yt}, {_V}* {tp}, i32 4, <{LANES} x i1> %tailmask)")
    yt0 = f.v(f"select <{LANES} x i1> %tailmask, {_V} {yt}, {_V} zeroinitializer")
    tot = f.reduce_many([f.v(f"fadd {_V} %ev2, {yt0}")])[0]
    f(f"  store float {mx}, float* %res, align 4")
    f(f"  store float {tot}, float* {f.v('getelementptr float, float* %res, i64 1')}, align 4")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


def _dispatch(name: str, args: str, heads: int, shifted: dict[str, str]) -> str:
    """{name}(i64 %g, ...): a switch on the group size to {name}{g}, a group larger than
    ``heads`` in passes of ``heads`` (each head's result is its own: the split changes no
    bit of it). ``shifted``: the pointer arguments that move by one head, and their row
    stride in floats."""
    names = [a.split()[1] for a in args.split(", ")]

    def call(group: int, g: int, first: int, L: list[str]) -> None:
        vals = []
        for a in names:
            if first and a[1:] in shifted:
                off = f"%{a[1:]}_{group}_{first}"
                L.append(f"  {off}o = mul i64 {shifted[a[1:]]}, {4 * first}")
                L.append(f"  {off} = add i64 {a}, {off}o")
                vals.append(f"i64 {off}")
            else:
                vals.append(("float " if a == "%scale" else "i64 ") + a)
        L.append(f"  call void @{name}{g}({', '.join(vals)})")

    L = [f"define void @{name}(i64 %g, {args}) nounwind {{", "entry:"]
    L.append(
        "  switch i64 %g, label %done [" + " ".join(f"i64 {g}, label %g{g}" for g in range(1, MAX_GROUP + 1)) + "]"
    )
    for g in range(1, MAX_GROUP + 1):
        L.append(f"g{g}:")
        for first in range(0, g, heads):
            call(g, min(heads, g - first), first, L)
        L.append("  br label %done")
    L += ["done:", "  ret void", "}"]
    return "\n".join(L)


# Rows of A per register tile of ``attn_gemm``: 6 rows x 16 columns are 12 ymm accumulators
# on AVX2 (of 16), with the row of B and a broadcast beside them (4 rows: 40 vs 42 GMAC/s).
GEMM_ROWS = 6
_GARGS = "float* %a, i64 %lda, float* %b, i64 %ldb, float* %c, i64 %ldc, i64 %r0, i64 %nc, i64 %depth, i1 %acc"


def _gemm_tile_ir(t: int) -> str:
    """attn_gemm_t{t}: rows r0..r0+t of C, every 16-column block: the t accumulators start
    from C (``acc``) or zero and take one multiply-add per k < depth, in k order."""
    f = _Ir()
    f(f"define internal void @attn_gemm_t{t}({_GARGS}) alwaysinline nounwind" + ' "min-legal-vector-width"="512" {')
    f("entry:")
    arows, crows = [], []
    for r in range(t):
        row = f.v(f"add i64 %r0, {r}")
        arows.append(f.v(f"getelementptr float, float* %a, i64 {f.v(f'mul i64 {row}, %lda')}"))
        crows.append(f.v(f"getelementptr float, float* %c, i64 {f.v(f'mul i64 {row}, %ldc')}"))
    f("  %anyk = icmp sgt i64 %depth, 0")
    f("  br label %col")
    f("col:")
    f("  %cb = phi i64 [0, %entry], [%cbn, %store]")
    f("  %e = shl i64 %cb, 4")
    f("  br i1 %acc, label %load, label %init")
    f("load:")
    olds = [f.load(cr, "%e") for cr in crows]
    f("  br label %init")
    f("init:")
    for r in range(t):
        f(f"  %i{r} = phi {_V} [zeroinitializer, %col], [{olds[r]}, %load]")
    f("  br i1 %anyk, label %kl, label %store")
    f("kl:")
    at = len(f.lines)
    bv = f.load("%b", f.v(f"add i64 {f.v('mul i64 %k, %ldb')}, %e"))
    new = []
    for r in range(t):
        av = f.v(f"load float, float* {f.v(f'getelementptr float, float* {arows[r]}, i64 %k')}, align 4")
        new.append(f.fma(f.splat(av), bv, f"%s{r}"))
    f("  %kn = add i64 %k, 1")
    f("  %km = icmp slt i64 %kn, %depth")
    f("  br i1 %km, label %kl, label %store")
    f.lines[at:at] = ["  %k = phi i64 [0, %init], [%kn, %kl]"] + [
        f"  %s{r} = phi {_V} [%i{r}, %init], [{new[r]}, %kl]" for r in range(t)
    ]
    f("store:")
    for r in range(t):
        f(f"  %o{r} = phi {_V} [%i{r}, %init], [{new[r]}, %kl]")
    for r in range(t):
        ptr = f.v(f"getelementptr float, float* {crows[r]}, i64 %e")
        f(f"  store {_V} %o{r}, {_V}* {f.v(f'bitcast float* {ptr} to {_V}*')}, align 4")
    f("  %cbn = add i64 %cb, 1")
    f("  %cm = icmp ult i64 %cbn, %nc")
    f("  br i1 %cm, label %col, label %done")
    f("done:")
    f("  ret void")
    f("}")
    return "\n".join(f.lines)


def _gemm_ir() -> str:
    """attn_gemm(a, lda, b, ldb, c, ldc, rows, cols, depth, acc): C[rows, cols] = A[rows,
    depth] B[depth, cols] (row strides lda, ldb, ldc floats), added to C when ``acc`` is
    not 0; cols a multiple of 16. Whole tiles of GEMM_ROWS rows, then one tile of the rest.
    Each element of C is its own chain of multiply-adds in k order: which rows share a
    call never changes a row's result."""
    t = GEMM_ROWS
    call = "(float* %a, i64 %lda, float* %b, i64 %ldb, float* %c, i64 %ldc, i64 {r}, i64 %nc, i64 %depth, i1 %acc)"
    L = [_gemm_tile_ir(r) for r in range(1, t + 1)]
    L += [
        "define void @attn_gemm(i64 %aa, i64 %lda, i64 %ba, i64 %ldb, i64 %ca, i64 %ldc, i64 %rows, i64 %cols,"
        " i64 %depth, i64 %acci) nounwind {",
        "entry:",
        "  %a = inttoptr i64 %aa to float*",
        "  %b = inttoptr i64 %ba to float*",
        "  %c = inttoptr i64 %ca to float*",
        "  %nc = lshr i64 %cols, 4",
        "  %acc = icmp ne i64 %acci, 0",
        f"  %rem = urem i64 %rows, {t}",
        "  %full = sub i64 %rows, %rem",
        "  %anyf = icmp sgt i64 %full, 0",
        "  %anyc = icmp ugt i64 %nc, 0",
        "  %go = and i1 %anyf, %anyc",
        "  br i1 %go, label %tiles, label %tail",
        "tiles:",
        "  %r = phi i64 [0, %entry], [%rn, %tiles]",
        f"  call void @attn_gemm_t{t}" + call.format(r="%r"),
        f"  %rn = add i64 %r, {t}",
        "  %rm = icmp slt i64 %rn, %full",
        "  br i1 %rm, label %tiles, label %tail",
        "tail:",
        "  %anyt = icmp ugt i64 %nc, 0",
        "  %rest = select i1 %anyt, i64 %rem, i64 0",
        "  switch i64 %rest, label %done [" + " ".join(f"i64 {r}, label %t{r}" for r in range(1, t)) + "]",
    ]
    for r in range(1, t):
        L += [f"t{r}:", f"  call void @attn_gemm_t{r}" + call.format(r="%full"), "  br label %done"]
    L += ["done:", "  ret void", "}"]
    return "\n".join(L)


def module_ir(layout: Layout = WIDE, kv: str = "f32") -> str:
    """The four entries (``AttentionLoops.NAMES``) for ``layout``; ``kv`` the cache's
    element type (f32 | f16): the decode loops read keys and values of that type."""
    elem = KV_ELEMS[kv]
    parts = [_DECLS]
    parts += [_scores_ir(g, layout.keys_per_pass(g), elem) for g in range(1, layout.heads + 1)]
    parts += [_values_ir(g, layout.keys_per_pass(g), elem) for g in range(1, layout.heads + 1)]
    parts.append(_dispatch("attn_scores", _SARGS, layout.heads, {"qa": "%d", "sa": "%ss"}))
    parts.append(_dispatch("attn_values", _VARGS, layout.heads, {"pa": "%ps", "oa": "%os"}))
    parts.append(_softmax_ir())
    parts.append(_gemm_ir())
    return "\n".join(parts)


def fits(d: int, dv: int) -> bool:
    """Whether heads of these dimensions take the IR loops (whole chunks of 16)."""
    return d > 0 and dv > 0 and d % LANES == 0 and dv % LANES == 0


def host_layout() -> Layout:
    """WIDE where the host has AVX-512's 32 vector registers, else NARROW."""
    import llvmlite.binding as llvm

    from cortiq_engine.kernels import qdot  # here: qdot imports the dtype records, which import jit, which imports this

    return WIDE if qdot.host_supports() and llvm.get_host_cpu_features().get("avx512f", False) else NARROW


class AttentionLoops:
    """The compiled loops: ``addrs`` is int64[4] (attn_scores, attn_values, attn_softmax,
    attn_gemm), zeros where the host lacks AVX2/FMA or ``enabled`` is False (``jit.attend``
    then runs its numba loops, and a prefill the BLAS blocks). ``kv``: the KV cache's
    element type the decode loops read (f32 | f16)."""

    NAMES = ("attn_scores", "attn_values", "attn_softmax", "attn_gemm")

    def __init__(
        self,
        enabled: bool | None = None,
        cache_dir: Path | None | str = "default",
        layout: Layout | None = None,
        kv: str = "f32",
    ) -> None:
        if kv not in KV_ELEMS:
            raise ValueError(f"no attention loops for a {kv!r} cache")
        self.addrs = np.zeros(len(self.NAMES), np.int64)
        self._engine = None  # the machine code lives as long as its engine
        self.layout = layout or host_layout()
        self.kv = kv
        from cortiq_engine.kernels import qdot

        if enabled is False or not qdot.host_supports():
            return
        compiled = llvm_jit.compile_ir(
            module_ir(self.layout, kv),
            self.NAMES,
            llvm_jit.default_cache_dir() if cache_dir == "default" else cache_dir,
        )
        self._engine = compiled.engine
        self.addrs = np.array([compiled.addrs[n] for n in self.NAMES], np.int64)

    def for_dims(self, d: int, dv: int) -> np.ndarray:
        """The addresses for heads of these dimensions (zeros: the numba loops)."""
        return self.addrs if fits(d, dv) else np.zeros(len(self.NAMES), np.int64)


_I64, _F32 = ir.IntType(64), ir.FloatType()


@intrinsic
def call_scores(typingctx, addr, g, q, k, m, d, scale, s, ss):
    """attn_scores at ``addr`` for a group of ``g`` heads: pointers and counts as int64, ``scale`` f32."""
    return (
        types.void(*([types.int64] * 6), types.float32, types.int64, types.int64),
        llvm_jit.call_by_address([_I64] * 5 + [_F32, _I64, _I64]),
    )


@intrinsic
def call_values(typingctx, addr, g, p, v, m, dv, o, ps, os):
    """attn_values at ``addr`` for a group of ``g`` heads: pointers and counts as int64."""
    return types.void(*([types.int64] * 9)), llvm_jit.call_by_address([_I64] * 8)


@intrinsic
def call_softmax(typingctx, addr, s, m, res):
    """attn_softmax at ``addr``: pointers and counts as int64."""
    return types.void(*([types.int64] * 4)), llvm_jit.call_by_address([_I64] * 3)


@intrinsic
def call_gemm(typingctx, addr, a, lda, b, ldb, c, ldc, rows, cols, depth, acc):
    """attn_gemm at ``addr``: pointers, strides and counts as int64."""
    return types.void(*([types.int64] * 11)), llvm_jit.call_by_address([_I64] * 10)
