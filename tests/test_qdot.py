"""The integer-activation kernels (q8, q4, q4_0, q5, q5_1, iq4_nl, q4k, q5k, q6k) against their float64 twin, row for row.

``kernels/qdot.py`` quantizes input rows to int16 (default) or int8 blocks and multiplies them by the
weight blocks in integers. Its oracle is ``qdot_ref``: the same quantized operands
multiplied in float64. Separately, the error quantizing activations adds is bounded
against the exact product with float activations.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine.kernels import fast, get_kernels, qdot
from cortiq_engine.kernels.fast import NumbaKernels
from cortiq_engine.weights import Weight
from tests.test_engine_kernels import _weight

RNG = np.random.default_rng(7)
needs_simd = pytest.mark.skipif(not qdot.host_supports(), reason="integer kernels need x86-64 with AVX2, FMA and F16C")


@pytest.mark.parametrize("bits", [8, 16])
def test_quantize_rows_equals_numpy_twin(bits):
    X = RNG.standard_normal((5, 128)).astype(np.float32) * np.float32(3)
    X[2, 32:64] = 0  # an all-zero block: scale 0, quants 0
    qmax = 2 ** (bits - 1) - 1
    xq = np.empty((5, 128), np.int8 if bits == 8 else np.int16)
    xd = np.empty((5, 4), np.float32)
    xs = np.empty((5, 4), np.float32)
    qdot.quantize_rows(X, xq, xd, xs, qmax)
    rq, rd, rs = qdot.quantize_rows_ref(X, bits)
    assert np.array_equal(xq, rq) and np.array_equal(xd, rd) and np.array_equal(xs, rs)
    assert np.abs(xq).max() == qmax and not xq[2, 32:64].any() and xd[2, 1] == 0
    # dequantized rows are within half a step of the input
    back = xq.reshape(5, 4, 32) * xd[:, :, None]
    assert np.all(np.abs(back.reshape(5, 128) - X) <= xd.repeat(32, axis=1) * 0.5 + 1e-7)


# (dtype, activation widths, columns): K-quant rows are super-blocks of 256.
# 32-block rows of 608 = two groups of 8 blocks and 3 left over (qdot._gbody).
INT_DTYPES = [
    ("q8", (16, 8), 608),
    ("q4", (16, 8), 608),
    ("q4_0", (16, 8), 608),
    ("q5", (16, 8), 608),
    ("q5_1", (16, 8), 608),
    ("iq4_nl", (16, 8), 608),
    ("q4k", (16, 8), 512),
    ("q5k", (16, 8), 512),
    ("q6k", (16, 8), 768),
]


@needs_simd
@pytest.mark.parametrize("dtype,bits,cols", [(d, b, c) for d, bs, c in INT_DTYPES for b in bs])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 13, 16])
def test_intdot_equals_float64_twin_and_is_row_exact(dtype, n, bits, cols):
    ks = NumbaKernels(act_bits=bits)
    ws = [_weight(dtype, r, cols, seed=i) for i, r in enumerate((50, 17, 33))]
    plan = ks._plans_for([w for w, _ in ws])[0][0]
    assert plan.fn is not None and plan.bits == bits  # the integer kernel is the one under test
    X = RNG.standard_normal((n, cols)).astype(np.float32)
    fast = ks.matmul([w for w, _ in ws], X)
    twin = np.concatenate([qdot.qdot_ref(dtype, w.parts, X, bits) for w, _ in ws], axis=1)
    assert np.abs(fast - twin).max() / np.abs(twin).max() < 2e-6
    # row-exact: each row alone gives the same bits (the speculative verify needs this)
    for i in range(n):
        assert np.array_equal(ks.matmul([w for w, _ in ws], X[i : i + 1])[0], fast[i])
    # the error integer activations add, against float activations and exact weights
    exact = X.astype(np.float64) @ np.concatenate([d for _, d in ws]).astype(np.float64).T
    rel = np.linalg.norm(fast - exact) / np.linalg.norm(exact)
    assert rel < (0.01 if bits == 8 else 1e-4), rel


@needs_simd
@pytest.mark.parametrize("dtype", ["q8", "q4", "q4_0", "q5", "q5_1", "iq4_nl"])
@pytest.mark.parametrize("cols", [32, 160, 256, 288, 1024])
@pytest.mark.parametrize("bits", [8, 16])
def test_grouped_kernel_every_group_and_tail_split(dtype, cols, bits):
    """Rows of whole groups only, leftover blocks only, and both: the float64 twin, row-exact."""
    ks = NumbaKernels(act_bits=bits)
    w, _ = _weight(dtype, 37, cols, seed=cols)
    X = RNG.standard_normal((6, cols)).astype(np.float32)
    fast = ks.matmul([w], X)
    twin = qdot.qdot_ref(dtype, w.parts, X, bits)
    assert np.abs(fast - twin).max() / np.abs(twin).max() < 2e-6
    for i in range(6):
        assert np.array_equal(ks.matmul([w], X[i : i + 1])[0], fast[i])


@pytest.mark.skipif(not qdot.host_vnni(), reason="this CPU has no VNNI: only the AVX2 form can run")
@pytest.mark.parametrize("dtype,bits,cols", [(d, b, c) for d, bs, c in INT_DTYPES for b in bs])
def test_vnni_and_avx2_forms_give_the_same_bits(dtype, bits, cols):
    """vpdpbusd/vpdpwssd add the same integers as vpmaddubsw + vpmaddwd: identical outputs."""
    ws = [_weight(dtype, r, cols, seed=i)[0] for i, r in enumerate((40, 9))]
    X = RNG.standard_normal((7, cols)).astype(np.float32) * np.float32(4)
    a = NumbaKernels(act_bits=bits, vnni=True).matmul(ws, X)
    b = NumbaKernels(act_bits=bits, vnni=False).matmul(ws, X)
    assert np.array_equal(a, b)
    # the VNNI form really calls them (q6k's int8 path keeps vpmaddwd for its per-16 scales)
    calls = qdot.module_ir(dtype, bits, vnni=True).count("call <8 x i32> @llvm.x86.avx512.vpdp")
    assert (calls == 0) if (dtype, bits) == ("q6k", 8) else (calls > 0)
    assert qdot.module_ir(dtype, bits, vnni=False).count("call <8 x i32> @llvm.x86.avx512.vpdp") == 0


@pytest.mark.skipif(not qdot.host_zmm(), reason="this CPU has no AVX-512 VNNI: the 4-row zmm bodies cannot run")
@pytest.mark.parametrize("dtype,bits", qdot.ZBODIES + qdot.WROWS_KINDS)
@pytest.mark.parametrize("cols", [32, 160, 256, 608, 2048])
def test_zmm_bodies_give_the_per_row_bodies_bits(dtype, bits, cols):
    """Calls on the zmm bodies (q4: 1 and 2 rows two blocks a vpdpbusd, 3 and 4 input rows
    side by side in 128-bit lanes; q8: four weight rows side by side, 37 / 16 / 5 rows
    leaving 1 / 0 / 1 to the per-row body) give exactly what the per-row bodies give, for
    whole groups, leftover blocks and both, with every split of 1..9 rows into calls of
    at most 4."""
    ws = [_weight(dtype, r, cols, seed=i + cols)[0] for i, r in enumerate((37, 16, 5))]
    zk, rk = NumbaKernels(act_bits=bits, zmm=True, zmm_min_weights=0), NumbaKernels(act_bits=bits, zmm=False)
    small = NumbaKernels(act_bits=bits, zmm=True, zmm_min_weights=fast.ZMM_MIN_WEIGHTS)
    assert not small._plans_for(ws)[0][0].zmm  # small, where 512-bit code slows the clock: per-row bodies
    assert zk._plans_for(ws)[0][0].zmm == ((dtype, bits) in qdot.ZBODIES) and not rk._plans_for(ws)[0][0].zmm
    X = RNG.standard_normal((9, cols)).astype(np.float32) * np.float32(3)
    X[2, : min(cols, 64)] = 0  # an all-zero block: scale 0
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9):
        z = zk.matmul(ws, X[:n])
        assert np.array_equal(z, rk.matmul(ws, X[:n]))
        assert np.array_equal(z[n - 1], zk.matmul(ws, X[n - 1 : n])[0])
    twin = np.concatenate([qdot.qdot_ref(dtype, w.parts, X, bits) for w in ws], axis=1)
    assert np.abs(zk.matmul(ws, X) - twin).max() / np.abs(twin).max() < 2e-6


def test_interleave_rows_layout():
    """The zmm bodies' copy: xt[b, k, r] is row r's k-th 16-byte chunk of block b, rows
    past nx zero; xdt / xst hold 4 blocks' scales of each row side by side."""
    n, cols = 3, 256
    xq = RNG.integers(-127, 128, (n, cols)).astype(np.int8)
    xd, xs = RNG.random((n, cols // 32), np.float32), RNG.random((n, cols // 32), np.float32)
    xt = np.full((cols // 32, 2, qdot.ZROWS, 16), 99, np.int8)
    xdt, xst = (np.full((cols // 128, qdot.ZROWS, 4), 9, np.float32) for _ in range(2))
    qdot.interleave_rows(xq, xd, xs, 0, n, xt, xdt, xst)
    want = np.zeros((cols // 32, 2, qdot.ZROWS, 16), np.int8)
    want[:, :, :n] = xq.reshape(n, cols // 32, 2, 16).transpose(1, 2, 0, 3)
    assert np.array_equal(xt, want)
    assert np.array_equal(xdt[:, :n], xd.reshape(n, -1, 4).transpose(1, 0, 2)) and not xdt[:, n:].any()
    assert np.array_equal(xst[:, :n], xs.reshape(n, -1, 4).transpose(1, 0, 2)) and not xst[:, n:].any()


def test_module_ir_zmm_entries():
    """With zmm, q4's calls take the zmm bodies (512-bit vpdpbusd: 1 and 2 rows two blocks
    a product, 3 and 4 rows side by side), q8's 3 and 4 rows the 4-weight-row ones
    (vpdpwssd) and its 1 and 2 rows the per-row bodies."""
    ir = qdot.module_ir("q4", 8, vnni=True, zmm=True)
    assert "call void @q4_rows4z(" in ir and "call void @q4_rows3z(" in ir
    assert "call void @q4_rows2p(" in ir and "call void @q4_rows1p(" in ir
    assert "@llvm.x86.avx512.vpdpbusd.512(" in ir
    ir8 = qdot.module_ir("q8", 16, vnni=True, zmm=True)
    assert "call void @q8a16_rows4w(" in ir8 and "call void @q8a16_rows2(" in ir8 and '"vpdpwssd $2, $1, $0"' in ir8
    assert "_rows4z" not in qdot.module_ir("q4", 8, vnni=True, zmm=False)


@needs_simd
@pytest.mark.parametrize("dtype", ["q4k", "q5k", "q6k"])
def test_kquant_integer_kernel_reads_every_scale_and_bit(dtype):
    """Extreme super-blocks (every 6-bit scale/min at its top bits, all-zero and
    all-max quants, q6k's negative scales) against the float64 twin."""
    cols, rows = 512, 24
    ks = NumbaKernels()
    w, _ = _weight(dtype, rows, cols, seed=11)
    rng = np.random.default_rng(5)
    parts = {k: np.ascontiguousarray(v).copy() for k, v in w.parts.items()}
    for k, v in parts.items():  # random bytes in every field but the f16 scales
        if k not in ("d", "dmin"):
            parts[k] = rng.integers(0, 256, v.shape, dtype=np.uint8).view(v.dtype)
    parts[next(k for k in parts if k not in ("d", "dmin"))][0] = 0xFF
    w2 = Weight("w", dtype, rows, cols, parts)
    X = rng.standard_normal((3, cols)).astype(np.float32)
    fast = ks.matmul([w2], X)
    twin = qdot.qdot_ref(dtype, parts, X, ks.act_bits[dtype])
    assert np.abs(fast - twin).max() / np.abs(twin).max() < 2e-6


@needs_simd
@pytest.mark.parametrize("kernels", ["numba", "numba-i8"])
def test_integer_and_float_kernel_sets_differ_only_by_activation_rounding(kernels):
    w, dense = _weight("q8", 64, 576, seed=3)
    X = RNG.standard_normal((1, 576)).astype(np.float32)
    a = get_kernels(kernels).matmul([w], X)
    b = get_kernels("numba-float").matmul([w], X)
    exact = X.astype(np.float64) @ dense.astype(np.float64).T
    assert np.abs(b - exact).max() / np.abs(exact).max() < 1e-5  # float path: exact up to f32 rounding
    assert not np.array_equal(a, b)  # the int8 path is really taken
    assert np.linalg.norm(a - exact) / np.linalg.norm(exact) < (0.01 if kernels == "numba-i8" else 1e-4)


def test_module_ir_declares_one_entry_per_dtype():
    ir = qdot.module_ir()
    entries = ("q8", "q4", "q8a16", "q4a16", "q4_0", "q4_0a16", "q5", "q5a16", "iq4_nl", "iq4_nla16")
    for entry in entries + ("q4k", "q5k", "q6k"):
        assert f"define void @{entry}_rows(" in ir
    assert ir.count("define internal void @q8_rows") == qdot.MAX_ROWS


@needs_simd
def test_default_widths_are_int16_for_q8_and_int8_for_q4():
    # q8 keeps int16 activations (its KL to f32 stays the float kernels'); q4 takes
    # ggml's int8 path, whose rounding is small beside q4's own weight error.
    default, i16, i8 = (get_kernels(k) for k in ("numba", "numba-i16", "numba-i8"))
    X = RNG.standard_normal((3, 160)).astype(np.float32)
    for dtype, same, other in (("q8", i16, i8), ("q4", i8, i16)):
        w, _ = _weight(dtype, 40, 160, seed=5)
        got = default.matmul([w], X)
        assert np.array_equal(got, same.matmul([w], X))
        assert not np.array_equal(got, other.matmul([w], X))


def _q6k_worst(rows: int, cols: int) -> Weight:
    """q6k weights at the integer sums' extreme: every |q - 32| = 32 and every scale -128, d = 1."""
    w, _ = _weight("q6k", rows, cols, seed=2)
    parts = {k: np.ascontiguousarray(v).copy() for k, v in w.parts.items()}
    parts["ql"][:] = 0
    parts["qh"][:] = 0
    parts["scales"][:] = -128
    parts["d"][:] = np.float16(1.0).view(np.uint16)
    return Weight("w", "q6k", rows, cols, parts)


@needs_simd
def test_q6k_int16_worst_case_group_fits_an_i32():
    """Every |q - 32| = 32, every scale -128, every activation at its top (16383 for q6k):
    each group's integer sum is 2,147,352,576, just under 2^31; the result is exact."""
    cols, rows = 512, 16
    X = np.ones((1, cols), np.float32)
    got = NumbaKernels(act_bits=16).matmul([_q6k_worst(rows, cols)], X)
    assert qdot.qmax("q6k", 16) == 16383 and 32 * 32 * 128 * 16383 < 2**31
    np.testing.assert_array_equal(got, np.full((1, rows), 32 * 128 * cols, np.float32))


def test_zmm_threshold_follows_the_cpu():
    """Every matrix takes the zmm bodies on CPUs that run 512-bit code at full clock, only
    large ones elsewhere; an explicit threshold wins."""
    import llvmlite.binding as llvm

    full = llvm.get_host_cpu_name() in fast.FULL_CLOCK_ZMM_CPUS
    assert fast.default_zmm_min_weights() == (0 if full else fast.ZMM_MIN_WEIGHTS)
    assert NumbaKernels(zmm_min_weights=7).zmm_min_weights == 7


def _random_kquant(w: Weight, rng: np.random.Generator) -> Weight:
    """``w`` with random bytes in every field but the f16 scales: every 6-bit scale and
    min bit, q6k's negative 8-bit scales, quants from 0 to their top."""
    parts = {k: np.ascontiguousarray(v).copy() for k, v in w.parts.items()}
    for k, v in parts.items():
        if k not in ("d", "dmin"):
            parts[k] = rng.integers(0, 256, v.shape, dtype=np.uint8).view(v.dtype)
    return Weight("w", w.dtype, w.rows, w.cols, parts)


@pytest.mark.skipif(not qdot.host_zmm(), reason="this CPU has no AVX-512 VNNI: the zmm bodies cannot run")
@pytest.mark.parametrize("dtype,bits", qdot.KPBODIES)
@pytest.mark.parametrize("cols", [256, 512, 2048])
def test_kquant_zmm_bodies_give_the_per_row_bodies_bits(dtype, bits, cols):
    """q4k's and q6k's 1- and 2-row zmm bodies (two groups a 512-bit product) give exactly
    what the per-row bodies give, for one and several super-blocks, random and extreme
    scale bytes, an all-zero activation block, activations spanning 2^40, and every split of
    1..9 rows into calls of at most 4 (3- and 4-row calls keep the per-row bodies)."""
    rng = np.random.default_rng(cols)
    ws = [_weight(dtype, r, cols, seed=i + cols)[0] for i, r in enumerate((37, 16, 5))]
    ws[1] = _random_kquant(ws[1], rng)
    zk, rk = NumbaKernels(act_bits=bits, zmm=True, zmm_min_weights=0), NumbaKernels(act_bits=bits, zmm=False)
    assert zk._plans_for(ws)[0][0].fn != rk._plans_for(ws)[0][0].fn  # the zmm entry is the one under test
    X = rng.standard_normal((9, cols)).astype(np.float32) * np.float32(3)
    X[2, :64] = 0  # an all-zero block: scale 0
    X[4] *= np.float32(2.0**20)
    X[5] *= np.float32(2.0**-20)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9):
        z = zk.matmul(ws, X[:n])
        assert np.array_equal(z, rk.matmul(ws, X[:n]))
        assert np.array_equal(z[n - 1], zk.matmul(ws, X[n - 1 : n])[0])
    got = zk.matmul(ws, X)
    twin = np.concatenate([qdot.qdot_ref(dtype, w.parts, X, bits) for w in ws], axis=1)
    scale = np.abs(twin).max(axis=1, keepdims=True)
    assert np.all(np.abs(got - twin) / scale < 2e-6)


@pytest.mark.skipif(not qdot.host_zmm(), reason="this CPU has no AVX-512 VNNI: the zmm bodies cannot run")
@pytest.mark.parametrize("bits", [8, 16])
def test_kquant_zmm_q6k_worst_case_group_fits_an_i32(bits):
    """The zmm q6k bodies on ``test_q6k_int16_worst_case_group_fits_an_i32``'s weights:
    their half sums meet the scales after the products (int8: x + 128 times the weights,
    less 128 times the weights' sums) and still give the per-row bodies' sums, exact on
    int16."""
    cols, rows = 512, 16
    X = np.ones((2, cols), np.float32)
    w = _q6k_worst(rows, cols)
    got = NumbaKernels(act_bits=bits, zmm=True, zmm_min_weights=0).matmul([w], X)
    assert np.array_equal(got, NumbaKernels(act_bits=bits, zmm=False).matmul([w], X))
    if bits == 16:
        np.testing.assert_array_equal(got, np.full((2, rows), 32 * 128 * cols, np.float32))
    X[:, ::3] = -1  # the activations' low end
    got = NumbaKernels(act_bits=bits, zmm=True, zmm_min_weights=0).matmul([w], X)
    assert np.array_equal(got, NumbaKernels(act_bits=bits, zmm=False).matmul([w], X))


def test_module_ir_kquant_zmm_entries():
    """With zmm, q4k's and q6k's 1- and 2-row calls take the K-quant zmm bodies, their 3-
    and 4-row calls the per-row bodies; without zmm every call takes the per-row bodies."""
    for dtype, bits in qdot.KPBODIES:
        name = qdot._entry(dtype, bits)
        ir = qdot.module_ir(dtype, bits, vnni=True, zmm=True)
        assert f"call void @{name}_rows1k(" in ir and f"call void @{name}_rows2k(" in ir
        assert f"call void @{name}_rows3(" in ir and f"call void @{name}_rows4(" in ir
        assert ".512(<16 x i32>" in ir
        assert "_rows1k" not in qdot.module_ir(dtype, bits, vnni=True, zmm=False)
