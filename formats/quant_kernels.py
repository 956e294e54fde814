"""Compiled (numba) q8/q4 quantizers and error meters for the converter.

They compute exactly what the numpy reference in ``formats.quants`` computes (and
so what ggml computes): the same f32 operations in the same order, no fused
multiply-add (numba leaves fastmath off), scales returned in f32 and rounded to
f16 by numpy. ``tests/test_formats_quants.py`` checks all three agree bit for bit.
The reference needs ~10 passes over a tensor; these need one: ``quantize_q8_measured``
and ``quantize_q4_measured`` also sum the encoding's squared error and the squared
values (a NaN or an infinity shows there) as they go, into the caller's arrays.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

QB = 32  # formats.quants.QBLOCK
_F0 = np.float32(0.0)
_F05 = np.float32(0.5)
_F1 = np.float32(1.0)
_F2 = np.float32(2.0)
_F15 = np.float32(15.0)
_F127 = np.float32(127.0)


@njit(inline="always")
def _amax(x, r, o):
    """max |x| of the block of 32 at row r, column o."""
    amax = _F0
    for j in range(QB):
        a = abs(x[r, o + j])
        if a > amax:
            amax = a
    return amax


@njit(cache=True, nogil=True)
def _q8_rows(x, d, qs):  # pragma: no cover - compiled
    rows, cols = x.shape
    for r in range(rows):
        for b in range(cols // QB):
            o = b * QB
            dd = _amax(x, r, o) / _F127
            inv = _F1 / dd if dd != _F0 else _F0
            d[r, b] = dd
            for j in range(QB):
                v = x[r, o + j] * inv
                a = abs(v)
                fl = np.floor(a)
                q = fl + np.floor(_F2 * (a - fl))  # C roundf: half away from zero, exactly
                qs[r, o + j] = np.int8(-q if v < _F0 else q)


@intrinsic
def _f16_round(typingctx, x):
    """f32 -> nearest f16 -> f32: the scale as it will be stored."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


_HALF_BELOW = np.float32(0.49999997)  # the f32 just below 0.5


@njit(inline="always")
def _q8_level(v):
    """C roundf(v) clamped to +-127. floor(|v| + 0.49999997) is roundf(|v|) for every
    f32 (checked exhaustively): one add and one floor, where v + 0.5 would round up
    the values just below a half."""
    q = np.floor(abs(v) + _HALF_BELOW)
    return min(max(-q if v < _F0 else q, -_F127), _F127)


# The scale searches (q8 here, q4_0 and q5 in ``formats.kquant_kernels``) score LANES
# candidate scales of a block side by side: one vector of f32 errors, each candidate's
# kept as NSUM partial sums (value j of a block adds to sum j % NSUM, in order; the sums
# add up as (s0 + s1) + (s2 + s3)). Independent sums keep the adds from waiting on each
# other, and a fixed order keeps the numpy reference's sums equal to these.
LANES = 16
NSUM = 4


@njit(inline="always")
def lanes_start(m, divs, cd, cinv, s0, s1, s2, s3):
    """The candidate scales f16(m / divs[k]) into cd, their inverses (0 for a zero
    scale) into cinv, the partial sums zeroed."""
    for k in range(LANES):
        c = _f16_round(m / divs[k])
        cd[k] = c
        cinv[k] = _F1 / c if c != _F0 else _F0
        s0[k] = _F0
        s1[k] = _F0
        s2[k] = _F0
        s3[k] = _F0


@njit(inline="always")
def lanes_best(cd, s0, s1, s2, s3):
    """The first nonzero candidate scale of least error, 0 if every one is 0."""
    best = _F0
    best_err = np.float32(np.inf)
    for k in range(LANES):
        ek = (s0[k] + s1[k]) + (s2[k] + s3[k])
        if cd[k] != _F0 and ek < best_err:
            best_err = ek
            best = cd[k]
    return best


# The q8 search, lane for lane the f32 operations of the numpy reference
# (``formats.quants.quantize_q8``), written as LLVM vector code: Q8_DIVISORS are the
# LANES lanes of one vector, and a level and its error are those of |x| (the decoder's
# products and differences are symmetric in the sign). A row goes in two passes: the
# first finds each block's max |x|, its candidate scales and their inverses (blocks are
# independent there, so their divisions overlap), the second scores the candidates, so
# no block waits on its own divisions.
_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)
_I32 = ir.IntType(32)
_VFABS = f"llvm.fabs.v{LANES}f32"
_VFLOOR = f"llvm.floor.v{LANES}f32"
_F16_MIN_NORMAL = 2.0**-14
_F16_MAX = 65504.0


def _vconst(v: float) -> ir.Constant:
    return ir.Constant(_VEC, [float(v)] * LANES)


def _splat(builder, s):
    v = builder.insert_element(ir.Constant(_VEC, ir.Undefined), s, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))


def _llvm(builder, name: str, ret, *args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(args))


def _vec_at(builder, arr, index):
    """A pointer to LANES f32 of the contiguous 1-D array ``arr``, from element ``index``."""
    return builder.bitcast(builder.gep(arr.data, [index]), _VEC.as_pointer())


def _plus(builder, index, n: int):
    return builder.add(index, ir.Constant(index.type, n))


def _reduce(builder, acc, op: str):
    """The lane that wins ``select(b op a, b, a)`` over a halving tree: min for "<", max
    for ">" (one compare and blend a step, where LLVM's reductions also order NaNs)."""
    n = LANES
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        acc = builder.select(builder.fcmp_ordered(op, hi, lo), hi, lo)
    return builder.extract_element(acc, ir.Constant(_I32, 0))


@intrinsic
def _q8_candidates(typingctx, x, at, ax, o, divs, cand, slot):
    """The block of 32 at element ``at`` of the flat ``x``: its |x| into ``ax[o:o + 32]``,
    the candidate scales f16(max|x| / divs) into ``cand[slot:slot + LANES]`` and their
    inverses (0 for a zero scale) into the next LANES."""
    sig = types.void(x, types.intp, ax, types.intp, divs, cand, types.intp)

    def codegen(context, builder, signature, args):
        xa, aa, da, ca = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4, 5))
        at, o, slot = args[1], args[3], args[6]
        zero = _vconst(0.0)
        acc = zero
        for h in range(0, QB, LANES):
            a = _llvm(builder, _VFABS, _VEC, builder.load(_vec_at(builder, xa, _plus(builder, at, h)), align=4))
            builder.store(a, _vec_at(builder, aa, _plus(builder, o, h)), align=4)
            # The max of the non-NaN values and 0, as the scalar ``if a > amax`` scan keeps it.
            acc = builder.select(builder.fcmp_ordered(">", a, acc), a, acc)
        m = _reduce(builder, acc, ">")  # no NaN in acc
        dv = builder.load(builder.bitcast(da.data, _VEC.as_pointer()), align=4)
        c = builder.fdiv(_splat(builder, m), dv)
        c = builder.fpext(builder.fptrunc(c, ir.VectorType(ir.HalfType(), LANES)), _VEC)
        inv = builder.select(builder.fcmp_unordered("!=", c, zero), builder.fdiv(_vconst(1.0), c), zero)
        builder.store(c, _vec_at(builder, ca, slot), align=4)
        builder.store(inv, _vec_at(builder, ca, _plus(builder, slot, LANES)), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _scores(builder, aa, o, c, inv, clamp: bool):
    """Each lane's squared error over the block of |x| at ``aa[o:o + 32]``: value j adds to
    partial sum j % NSUM, the sums add as (s0 + s1) + (s2 + s3)."""
    half = _vconst(_HALF_BELOW)
    top = _vconst(127.0)
    sums = [_vconst(0.0)] * NSUM
    for j in range(QB):
        a = _splat(builder, builder.load(builder.gep(aa.data, [_plus(builder, o, j)]), align=4))
        level = _llvm(builder, _VFLOOR, _VEC, builder.fadd(builder.fmul(a, inv), half))
        if clamp:  # min(level, 127), as numba's min: 127 where 127 < level
            level = builder.select(builder.fcmp_ordered("<", top, level), top, level)
        e = builder.fsub(a, builder.fmul(level, c))
        sums[j % NSUM] = builder.fadd(sums[j % NSUM], builder.fmul(e, e))
    return builder.fadd(builder.fadd(sums[0], sums[1]), builder.fadd(sums[2], sums[3]))


@intrinsic
def _q8_pick(typingctx, ax, o, cand, slot):
    """The scale of least squared error among the candidates at ``cand[slot]`` for the
    block of |x| at ``ax[o:o + 32]``: the first nonzero one of least error, 0 if none."""
    sig = types.float32(ax, types.intp, cand, types.intp)

    def codegen(context, builder, signature, args):
        aa, ca = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2))
        o, slot = args[1], args[3]
        inf = _vconst(float("inf"))
        c = builder.load(_vec_at(builder, ca, slot), align=4)
        inv = builder.load(_vec_at(builder, ca, _plus(builder, slot, LANES)), align=4)
        # Every candidate a normal f16 (the divisors descend, so lane 0 is the least scale):
        # then m / c <= 127 * (1 + 2^-11) / (1 - 2^-24), no level passes 127, and the clamp
        # changes nothing.
        lo_c = builder.extract_element(c, ir.Constant(_I32, 0))
        hi_c = builder.extract_element(c, ir.Constant(_I32, LANES - 1))
        normal = builder.and_(
            builder.fcmp_ordered(">=", lo_c, ir.Constant(_F32, _F16_MIN_NORMAL)),
            builder.fcmp_ordered("<=", hi_c, ir.Constant(_F32, _F16_MAX)),
        )
        with builder.if_else(normal) as (fast, slow):
            with fast:
                ek_fast = _scores(builder, aa, o, c, inv, clamp=False)
                bb_fast = builder.block
            with slow:
                ek_slow = _scores(builder, aa, o, c, inv, clamp=True)
                bb_slow = builder.block
        ek = builder.phi(_VEC)
        ek.add_incoming(ek_fast, bb_fast)
        ek.add_incoming(ek_slow, bb_slow)
        # The reference's scan keeps a lane whose error is below every earlier lane's (from
        # +inf) and whose scale is nonzero: the first lane of least finite error.
        ok = builder.and_(builder.fcmp_unordered("!=", c, _vconst(0.0)), builder.fcmp_ordered("<", ek, inf))
        masked = builder.select(ok, ek, inf)
        least = _reduce(builder, masked, "<")  # no NaN in masked
        hits = builder.bitcast(builder.fcmp_ordered("==", masked, _splat(builder, least)), ir.IntType(LANES))
        k = _llvm(builder, f"llvm.cttz.i{LANES}", ir.IntType(LANES), hits, ir.Constant(ir.IntType(1), 0))
        best = builder.extract_element(c, k)
        found = builder.fcmp_ordered("<", least, ir.Constant(_F32, float("inf")))
        return builder.select(found, best, ir.Constant(_F32, 0.0))

    return sig, codegen


# Reassociation lets the sums vectorize; the element errors themselves are exact.
@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _row_error(x, d, m, qs, nibbles):  # pragma: no cover - compiled
    """(sum of squared errors, sum of squared values) of one row ``x`` of an encoding whose
    blocks of 32 decode to q * d + m (``_affine_error``'s sums, for one row)."""
    err = 0.0
    ref = 0.0
    for b in range(x.shape[0] // QB):
        dd = d[b]
        mm = m[b]
        if nibbles:  # byte j: element j in its low nibble, j + 16 in its high one
            for j in range(QB // 2):
                byte = qs[b * 16 + j]
                lo = x[b * QB + j]
                hi = x[b * QB + 16 + j]
                e0 = np.float64(np.float32(byte & 15) * dd + mm - lo)
                e1 = np.float64(np.float32(byte >> 4) * dd + mm - hi)
                err += e0 * e0 + e1 * e1
                ref += np.float64(lo) * np.float64(lo) + np.float64(hi) * np.float64(hi)
        else:
            for j in range(QB):
                v = x[b * QB + j]
                e = np.float64(np.float32(qs[b * QB + j]) * dd + mm - v)
                err += e * e
                ref += np.float64(v) * np.float64(v)
    return err, ref


@njit(cache=True, nogil=True, error_model="numpy")
def _q8_rows_search(x, divs, d, qs, ax, cand, zeros, sums):  # pragma: no cover - compiled
    """The searched q8 encoding of ``x`` into ``d`` (f32) and ``qs``; ``sums`` gets (sum of
    squared errors, sum of squared values) of the encoding, in f64. ``ax`` (f32[cols]),
    ``cand`` (f32[cols // 32 * 2 * LANES]) are scratch, ``zeros`` f32[cols // 32]."""
    rows, cols = x.shape
    nb = cols // QB
    flat = x.reshape(-1)
    err = 0.0
    ref = 0.0
    for r in range(rows):
        for b in range(nb):
            _q8_candidates(flat, r * cols + b * QB, ax, b * QB, divs, cand, b * 2 * LANES)
        for b in range(nb):
            best = _q8_pick(ax, b * QB, cand, b * 2 * LANES)
            d[r, b] = best
            iv = _F1 / best if best != _F0 else _F0
            for j in range(QB):
                qs[r, b * QB + j] = np.int8(_q8_level(x[r, b * QB + j] * iv))
        e, v = _row_error(x[r], d[r], zeros, qs[r], False)
        err += e
        ref += v
    sums[0] += err
    sums[1] += ref


def _block_extreme(op: str):
    """An intrinsic (x, at) -> the min (op "<") or max (">") of the block of 32 at element
    ``at`` of the flat ``x``, as the scalar scan from x[at] keeping v where v op the
    extreme: lanes start at x[at], so a NaN sticks only from there. A result of zero may
    carry the wrong sign (the scan keeps the first zero); the caller rescans then."""

    @intrinsic
    def extreme(typingctx, x, at):
        sig = types.float32(x, types.intp)

        def codegen(context, builder, signature, args):
            xa = context.make_array(signature.args[0])(context, builder, args[0])
            at = args[1]
            acc = _splat(builder, builder.load(builder.gep(xa.data, [at]), align=4))
            for h in range(0, QB, LANES):
                v = builder.load(_vec_at(builder, xa, _plus(builder, at, h)), align=4)
                acc = builder.select(builder.fcmp_ordered(op, v, acc), v, acc)
            return _reduce(builder, acc, op)

        return sig, codegen

    return extreme


_block_min = _block_extreme("<")
_block_max = _block_extreme(">")


@njit(cache=True, nogil=True)
def _q4_rows(x, d, m, qs, fd, fm, sums):  # pragma: no cover - compiled
    """ggml's Q4_1 of ``x`` into ``d``, ``m`` (f32) and ``qs``; ``sums`` gets (sum of squared
    errors, sum of squared values) of the encoding in f64 (``fd``, ``fm``: scratch for the
    f16-rounded d and m the decoder reads)."""
    rows, cols = x.shape
    flat = x.reshape(-1)
    err = 0.0
    ref = 0.0
    for r in range(rows):
        for b in range(cols // QB):
            o = b * QB
            lo = _block_min(flat, r * cols + o)
            hi = _block_max(flat, r * cols + o)
            if lo == _F0 or hi == _F0:  # the sign of a zero: the scan's own
                lo = x[r, o]
                hi = x[r, o]
                for j in range(1, QB):
                    v = x[r, o + j]
                    if v < lo:
                        lo = v
                    if v > hi:
                        hi = v
            dd = (hi - lo) / _F15
            inv = _F1 / dd if dd != _F0 else _F0
            d[r, b] = dd
            m[r, b] = lo
            fd[r, b] = _f16_round(dd)
            fm[r, b] = _f16_round(lo)
            for j in range(QB // 2):
                q0 = min(np.int32((x[r, o + j] - lo) * inv + _F05), 15)
                q1 = min(np.int32((x[r, o + j + 16] - lo) * inv + _F05), 15)
                qs[r, o // 2 + j] = np.uint8(q0 | (q1 << 4))
        e, v = _row_error(x[r], fd[r], fm[r], qs[r], True)
        err += e
        ref += v
    sums[0] += err
    sums[1] += ref


# Reassociation lets the sums vectorize; the element errors themselves are exact.
@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _affine_error(x, d, m, qs, nibbles, offset):  # pragma: no cover - compiled
    """(sum of squared errors, sum of squared values) of blocks of 32 decoding to
    (q + offset) * d + m: q8's levels are qs itself (m = 0), q4's and q4_0's the nibbles
    of qs (element j in the low nibble of byte j, j + 16 in its high nibble; q4_0's
    offset -8, m = 0)."""
    rows, cols = x.shape
    err = 0.0
    ref = 0.0
    for r in range(rows):
        for b in range(cols // QB):
            dd = d[r, b]
            mm = m[r, b]
            for j in range(QB):
                if nibbles:
                    q = np.float32(((qs[r, b * 16 + j % 16] >> (4 * (j // 16))) & 15) + offset)
                else:
                    q = np.float32(qs[r, b * QB + j])
                v = x[r, b * QB + j]
                e = np.float64(q * dd + mm - v)
                err += e * e
                ref += np.float64(v) * np.float64(v)
    return err, ref


def _rows_into(x: np.ndarray, shapes: list[tuple[int, int]], dtypes: list[str], into: list[np.ndarray] | None):
    """The part arrays a kernel fills: the caller's list (C-contiguous rows of its tensor's
    parts), else new ones."""
    if into is not None:
        assert all(a.shape == s and a.flags.c_contiguous for a, s in zip(into, shapes))
        return into
    return [np.empty(s, t) for s, t in zip(shapes, dtypes)]


def quantize_q8_measured(x: np.ndarray, into: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], float, float]:
    """``quantize_q8``'s parts (written into ``into`` if given) with the encoding's (sum of
    squared errors, sum of squared values), in one pass over ``x``; a NaN or an infinity
    in ``x`` gives a sum of squared values that is not finite."""
    from formats.quants import Q8_DIVISORS

    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    nb = cols // QB
    parts = _rows_into(x, [(rows, nb), (rows, cols)], ["<f2", "i1"], into)
    d16, qs = parts
    d = np.empty((rows, nb), np.float32)
    sums = np.zeros(2)
    assert Q8_DIVISORS.shape == (LANES,)
    ax = np.empty(cols, np.float32)
    cand = np.empty(nb * 2 * LANES, np.float32)
    _q8_rows_search(x, Q8_DIVISORS, d, qs, ax, cand, np.zeros(nb, np.float32), sums)
    np.copyto(d16, d, casting="same_kind")
    return parts, float(sums[0]), float(sums[1])


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q8`` (the searched scale)."""
    d, qs = quantize_q8_measured(x)[0]
    return d, qs


def quantize_q8_ggml(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q8_ggml``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    d = np.empty((rows, cols // QB), np.float32)
    qs = np.empty((rows, cols), np.int8)
    _q8_rows(x, d, qs)
    return d.astype(np.float16), qs


def quantize_q4_measured(x: np.ndarray, into: list[np.ndarray] | None = None) -> tuple[list[np.ndarray], float, float]:
    """``quantize_q4``'s parts with their error sums, as ``quantize_q8_measured``."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    nb = cols // QB
    parts = _rows_into(x, [(rows, nb), (rows, nb), (rows, cols // 2)], ["<f2", "<f2", "u1"], into)
    d16, m16, qs = parts
    d, m, fd, fm = (np.empty((rows, nb), np.float32) for _ in range(4))
    sums = np.zeros(2)
    _q4_rows(x, d, m, qs, fd, fm, sums)
    np.copyto(d16, d, casting="same_kind")
    np.copyto(m16, m, casting="same_kind")
    return parts, float(sums[0]), float(sums[1])


def quantize_q4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Same contract and bytes as ``formats.quants.quantize_q4``."""
    d, m, qs = quantize_q4_measured(x)[0]
    return d, m, qs


def q8_error(x: np.ndarray, d: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    """(sum of squared errors, sum of squared values) of a q8 encoding of ``x`` [rows, cols]."""
    d32 = d.astype(np.float32)
    return _affine_error(np.ascontiguousarray(x, np.float32), d32, np.zeros_like(d32), qs, False, 0)


def q4_error(x: np.ndarray, d: np.ndarray, m: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    return _affine_error(np.ascontiguousarray(x, np.float32), d.astype(np.float32), m.astype(np.float32), qs, True, 0)


def q4_0_error(x: np.ndarray, d: np.ndarray, qs: np.ndarray) -> tuple[float, float]:
    """As ``q8_error``, of a q4_0 encoding (value = d * (q - 8): + 0 changes no product)."""
    d32 = d.astype(np.float32)
    return _affine_error(np.ascontiguousarray(x, np.float32), d32, np.zeros_like(d32), qs, True, -8)


@njit(cache=True, parallel=True)
def _launch(a):  # pragma: no cover - compiled
    for i in prange(a.shape[0]):
        a[i] = i


def parallel_calls_safe() -> bool:
    """Whether numba's threading layer takes parallel kernels from several threads at
    once (tbb and omp do; workqueue aborts the process)."""
    import numba

    _launch(np.zeros(1))  # the layer is chosen at the first parallel launch
    return numba.threading_layer() != "workqueue"
