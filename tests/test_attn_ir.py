"""The LLVM IR attention loops (``cortiq_engine/kernels/attn_ir.py``) against float64
math, one loop at a time, inside ``jit.attend`` (decode and verify: row-exact) and inside
``jit.attend_flash`` (prefill: the same bits on any number of threads); the numba loops
and BLAS blocks they replace kept for other head sizes and hosts."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from numba import njit

from cortiq_engine.kernels import attn_ir, jit, qdot
from cortiq_engine.kernels.fast import NumbaKernels
from tests.attn_calls import gemm as _gemm, scores as _scores, softmax as _softmax, values as _values

RNG = np.random.default_rng(11)

if not qdot.host_supports():  # pragma: no cover - every CI host so far has AVX2/FMA
    pytest.skip("attn_ir needs x86-64 AVX2/FMA; jit.attend keeps its numba loops there", allow_module_level=True)

LOOPS = attn_ir.AttentionLoops()
# Both register layouts compile and run on any AVX2 host (the wide one spills there):
# each is held to the same float64 math.
LAYOUTS = {layout: attn_ir.AttentionLoops(layout=layout) for layout in (attn_ir.WIDE, attn_ir.NARROW)}


def test_compiled_on_this_host():
    assert (LOOPS.addrs != 0).all()
    assert attn_ir.fits(64, 64) and attn_ir.fits(256, 16) and not attn_ir.fits(64, 12) and not attn_ir.fits(8, 16)
    assert (LOOPS.for_dims(64, 48) == LOOPS.addrs).all() and not LOOPS.for_dims(16, 12).any()
    assert LOOPS.for_dims(16, 12).shape == LOOPS.addrs.shape == (len(attn_ir.AttentionLoops.NAMES),)
    assert not attn_ir.AttentionLoops(False).addrs.any()
    import llvmlite.binding as llvm

    wide = llvm.get_host_cpu_features().get("avx512f", False)
    assert LOOPS.layout == attn_ir.host_layout() == (attn_ir.WIDE if wide else attn_ir.NARROW)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda lay: f"heads{lay.heads}-chains{lay.chains}")
def test_a_group_split_into_passes_keeps_each_heads_scores(layout):
    """A group larger than the layout's heads per pass runs in passes; in a pass or not,
    a head's scores are its own sums (one accumulator per key, a fixed lane fold): the
    same bits as the head alone."""
    addrs = LAYOUTS[layout].addrs
    for g in sorted({3, min(layout.heads + 1, attn_ir.MAX_GROUP), attn_ir.MAX_GROUP}):
        q = RNG.standard_normal((g, 64)).astype(np.float32)
        k = RNG.standard_normal((37, 64)).astype(np.float32)
        s = np.zeros((g, 40), np.float32)
        _scores(addrs[0], g, q, k, 37, np.float32(0.125), s)
        for h in range(g):
            one = np.zeros((1, 40), np.float32)
            _scores(addrs[0], 1, q[h : h + 1].copy(), k, 37, np.float32(0.125), one)
            assert np.array_equal(one[0, :37], s[h, :37]), (g, h)


# every group size (1..8: keys per pass 8, 4, 2, 2, 1, ... in the wide layout; passes
# of 4 heads in the narrow one), key counts around the passes
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda lay: f"heads{lay.heads}-chains{lay.chains}")
@pytest.mark.parametrize("g", range(1, attn_ir.MAX_GROUP + 1))
@pytest.mark.parametrize("d", [16, 64, 256])
def test_scores_against_float64(g, d, layout):
    for m in (1, 2, 3, 7, 8, 9, 17, 40):
        q = RNG.standard_normal((g, d)).astype(np.float32)
        k = RNG.standard_normal((m, d)).astype(np.float32)
        s = np.full((g, 48), 9.0, np.float32)  # a row stride past m: the rest untouched
        _scores(LAYOUTS[layout].addrs[0], g, q, k, m, np.float32(0.125), s)
        exact = q.astype(np.float64) @ k.T.astype(np.float64) * 0.125
        np.testing.assert_allclose(s[:, :m], exact, rtol=0, atol=2e-6 * np.sqrt(d))
        assert (s[:, m:] == 9.0).all()


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda lay: f"heads{lay.heads}-chains{lay.chains}")
@pytest.mark.parametrize("g", range(1, attn_ir.MAX_GROUP + 1))
@pytest.mark.parametrize("dv", [16, 48, 256])
def test_values_against_float64(g, dv, layout):
    for m in (1, 2, 3, 7, 8, 9, 17, 40):
        p = np.zeros((g, 48), np.float32)
        p[:, :m] = RNG.random((g, m))
        v = RNG.standard_normal((m, dv)).astype(np.float32)
        o = np.full((g, dv + 16), 9.0, np.float32)
        _values(LAYOUTS[layout].addrs[1], g, p, v, m, o)
        exact = p[:, :m].astype(np.float64) @ v.astype(np.float64)
        np.testing.assert_allclose(o[:, :dv], exact, rtol=0, atol=2e-6 * np.sqrt(m))
        assert (o[:, dv:] == 9.0).all()


def test_softmax_against_float64_and_the_numba_exp():
    for m in (1, 5, 15, 16, 17, 31, 32, 100, 256):
        x = (RNG.standard_normal(m + 3) * 6).astype(np.float32)
        x[0] = -200.0  # below exp's clamp at -87
        s, res = x.copy(), np.zeros(2, np.float32)
        _softmax(LOOPS.addrs[2], s, m, res)
        mx = x[:m].max()
        assert res[0] == mx
        diff = (x[:m] - mx).astype(np.float32)  # the kernels' own f32 difference
        exact = np.exp(np.maximum(diff.astype(np.float64), -87.0))
        assert np.max(np.abs(s[:m] - exact) / exact) < 3e-7, m
        assert abs(res[1] - exact.sum()) / exact.sum() < 1e-6
        numba_exp = np.empty(m, np.float32)
        jit.exp_nonpositive_array(diff, numba_exp)
        np.testing.assert_allclose(s[:m], numba_exp, rtol=3e-7, atol=0)
        assert (s[m:] == x[m:]).all()  # the masked last chunk writes nothing past m


# rows around the register tile (GEMM_ROWS = 6: whole tiles, a remainder, both), column
# blocks of 16, depths from one multiply-add up
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 96])
@pytest.mark.parametrize("cols,depth", [(16, 1), (48, 3), (128, 64), (64, 130)])
def test_gemm_against_float64(rows, cols, depth):
    a = RNG.standard_normal((rows, depth + 5)).astype(np.float32)  # strides past the widths
    b = RNG.standard_normal((depth + 2, cols + 16)).astype(np.float32)
    c0 = RNG.standard_normal((rows + 2, cols + 32)).astype(np.float32)
    exact = a[:, :depth].astype(np.float64) @ b[:depth, :cols].astype(np.float64)
    for acc in (0, 1):
        c = c0.copy()
        _gemm(LOOPS.addrs[3], a, b, c, rows, cols, depth, acc)
        want = exact + (c0[:rows, :cols] if acc else 0)
        np.testing.assert_allclose(c[:rows, :cols], want, rtol=0, atol=2e-6 * np.sqrt(depth) + 1e-6)
        assert np.array_equal(c[:rows, cols:], c0[:rows, cols:]) and np.array_equal(c[rows:], c0[rows:])
    # a row's result never depends on which rows share the call (its tile or the remainder)
    one = np.zeros((rows, cols + 32), np.float32)
    for r in range(rows):
        _gemm(LOOPS.addrs[3], a[r : r + 1].copy(), b, one[r : r + 1], 1, cols, depth, 0)
    all_rows = np.zeros_like(one)
    _gemm(LOOPS.addrs[3], a, b, all_rows, rows, cols, depth, 0)
    assert np.array_equal(all_rows, one)


def test_gemm_without_work_writes_nothing():
    a, b = np.ones((6, 4), np.float32), np.ones((4, 16), np.float32)
    for rows, cols, depth, acc in ((0, 16, 4, 0), (6, 0, 4, 0), (6, 16, 0, 1)):
        c = np.full((6, 16), 7.0, np.float32)
        _gemm(LOOPS.addrs[3], a, b, c, rows, cols, depth, acc)
        assert (c == 7.0).all()  # depth 0 with acc: C + nothing
    c = np.full((6, 16), 7.0, np.float32)
    _gemm(LOOPS.addrs[3], a, b, c, 6, 16, 0, 0)
    assert (c == 0.0).all()  # depth 0 without acc: an empty sum


@njit(nogil=True)
def _pull_all(counter, n, taken, who):
    while True:
        t = jit.fetch_add(counter.ctypes.data)
        if t >= n:
            return
        taken[t] += 1
        for _ in range(200):  # some work, so the threads interleave
            who[t] = who[t] * 3 % 7919 + 1


def test_fetch_add_hands_every_job_out_once():
    n = 20000
    counter, taken, who = np.zeros(1, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    threads = [threading.Thread(target=_pull_all, args=(counter, n, taken, who)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (taken == 1).all() and counter[0] == n + 4  # each thread's last pull finds none


def _attention64(q, kc, vc, start, window, scale, sinks):
    n, heads, _ = q.shape
    group = heads // kc.shape[0]
    out = np.zeros((n, heads, vc.shape[2]))
    for i in range(n):
        hi = start + i + 1
        lo = max(0, hi - window) if window > 0 else 0
        for h in range(heads):
            s = kc[h // group, lo:hi].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            z = s if sinks is None else np.append(s, np.float64(sinks[h]))
            p = np.exp(z - z.max())
            p /= p.sum()
            out[i, h] = p[: hi - lo] @ vc[h // group, lo:hi].astype(np.float64)
    return out


# group sizes 1, 3, 8 and 10 (two calls: 8 + 2); caches long enough for several chunks
@pytest.mark.parametrize(
    "heads,kvh,d,dv", [(4, 4, 64, 64), (9, 3, 64, 64), (32, 4, 64, 64), (20, 2, 32, 16), (4, 1, 256, 256)]
)
@pytest.mark.parametrize("window,sinks", [(0, False), (300, True)])
@pytest.mark.parametrize("n", [5, 100])  # a verify (row-exact); a prefill chunk (attend_flash; BLAS without the IR)
def test_attend_through_the_ir_loops(heads, kvh, d, dv, window, sinks, n):
    ks = NumbaKernels()
    plain = NumbaKernels(attn_loops=False)
    start, cap = 2 * jit.ATTN_CHUNK + 5, 700
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, cap, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, cap, dv)).astype(np.float32)
    sk = (RNG.standard_normal(heads) * 2).astype(np.float32) if sinks else None
    exact = _attention64(q, kc, vc, start, window, d**-0.5, sk)
    got = ks.attend(q, kc, vc, start, window, d**-0.5, sk)
    # a prefill scales the queries before the products (one more rounding): a few ulps of the outputs
    np.testing.assert_allclose(got, exact, atol=2e-6 if n <= ks.row_exact_rows else 3e-6)
    np.testing.assert_allclose(plain.attend(q, kc, vc, start, window, d**-0.5, sk), exact, atol=2e-6)
    if n <= ks.row_exact_rows:
        # row-exact: each query alone gives the same bits (the speculative verify's contract)
        one = np.concatenate([ks.attend(q[i : i + 1].copy(), kc, vc, start + i, window, d**-0.5, sk) for i in range(n)])
        assert np.array_equal(got, one)


# prefill shapes around the job and key-block sizes: queries 17 (just past the verify) to
# 3 jobs and a part, keys from one block to several and a part, windows that cut blocks
@pytest.mark.parametrize("n,start", [(17, 0), (33, 3), (2 * jit.FLASH_QUERIES + 5, jit.FLASH_KEYS - 1), (100, 517)])
@pytest.mark.parametrize("window,sinks", [(0, False), (7, False), (40, True), (300, True)])
@pytest.mark.parametrize("heads,kvh,d,dv", [(9, 3, 64, 64), (6, 2, 16, 48), (4, 1, 256, 256)])
def test_prefill_attention_against_float64_on_any_thread_count(n, start, window, sinks, heads, kvh, d, dv):
    ks = NumbaKernels()
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, start + n + 3, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, start + n + 3, dv)).astype(np.float32)
    sk = (RNG.standard_normal(heads) * 2).astype(np.float32) if sinks else None
    exact = _attention64(q, kc, vc, start, window, d**-0.5, sk)
    before = numba.get_num_threads()
    try:
        outs = []
        for threads in sorted({1, 2, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            outs.append(ks.attend(q, kc, vc, start, window, d**-0.5, sk))
    finally:
        numba.set_num_threads(before)
    np.testing.assert_allclose(outs[0], exact, atol=3e-6)
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])  # which thread ran a job never changes its bits


def test_a_prefill_without_the_ir_loops_takes_the_blas_blocks():
    """Heads the IR loops do not serve (or a host without AVX2/FMA) take the BLAS blocks;
    both routes give float64's result, in their own roundings."""
    heads, kvh, d, n, start = 8, 2, 64, 60, 300
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, 400, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, 400, d)).astype(np.float32)
    exact = _attention64(q, kc, vc, start, 0, 0.125, None)
    flash = NumbaKernels().attend(q, kc, vc, start, 0, 0.125)
    blas = NumbaKernels(attn_loops=False).attend(q, kc, vc, start, 0, 0.125)
    np.testing.assert_allclose(flash, exact, atol=3e-6)
    np.testing.assert_allclose(blas, exact, atol=2e-6)
    assert not np.array_equal(flash, blas)  # two different routes


def test_a_non_contiguous_cache_takes_the_numba_loops():
    """The IR loops address rows by a C layout; a strided view must not reach them."""
    ks = NumbaKernels()
    big = RNG.standard_normal((2, 300, 128)).astype(np.float32)
    kc, vc = big[:, :, :64], big[:, :, 64:]
    for n in (1, 40):  # a decode row (numba's loops), a prefill (the BLAS blocks)
        q = RNG.standard_normal((n, 4, 64)).astype(np.float32)
        exact = _attention64(q, kc, vc, 300 - n, 0, 0.125, None)
        np.testing.assert_allclose(ks.attend(q, kc, vc, 300 - n, 0, 0.125), exact, atol=2e-6)
