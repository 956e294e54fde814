"""The fast (numba) kernel set against the numpy reference, op by op, and the
reference against plainly written float64 math."""

from __future__ import annotations

import numpy as np
import pytest

from formats.quants import get_dtype
from cortiq_engine.kernels import get_kernels
from cortiq_engine.kernels.fast import SMALL_N
from cortiq_engine.kernels.reference import AttentionCall, softcap_attend
from cortiq_engine.weights import Weight

RNG = np.random.default_rng(0)


def _weight(dtype: str, rows: int, cols: int, seed: int = 0) -> tuple[Weight, np.ndarray]:
    """A Weight of ``dtype`` and its exact f32 values (decoded from the same bytes)."""
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    dt = get_dtype(dtype)
    parts = dt.named(dt.encode(x), (rows, cols))
    parts = {k: (v.view(np.uint16) if v.dtype == np.float16 else v) for k, v in parts.items()}
    if dtype in ("f32", "f16", "bf16"):
        parts["data"] = parts["data"].reshape(rows, cols)
    w = Weight("w", dtype, rows, cols, parts)
    return w, w.dequantize()


@pytest.mark.parametrize("dtype", ["q8", "q4", "f16", "bf16", "f32"])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 40])
def test_matmul_fused_fast_equals_reference_and_exact(dtype, n):
    cols = 96 if dtype in ("q8", "q4") else 70  # half types: a width that is not a multiple of 32
    ws = [_weight(dtype, r, cols, seed=i) for i, r in enumerate((50, 17, 33))]
    X = RNG.standard_normal((n, cols)).astype(np.float32)
    exact = X.astype(np.float64) @ np.concatenate([d for _, d in ws]).astype(np.float64).T
    fast = get_kernels("numba-float").matmul([w for w, _ in ws], X)
    ref = get_kernels("numpy").matmul([w for w, _ in ws], X)
    scale = np.abs(exact).max()
    assert np.abs(ref - exact).max() / scale < 1e-5
    assert np.abs(fast - exact).max() / scale < 1e-5
    if dtype not in ("q8", "q4") or n > SMALL_N:
        # float activations here too (q8/q4 decode batches: int8, tests/test_qdot.py), but
        # for prefill on integer tiles the decode's width, q8 int16, q4 int8
        # (tests/test_amx.py holds them to qdot_ref)
        ks = get_kernels("numba")
        default = ks.matmul([w for w, _ in ws], X)
        tiled = dtype in ks.amx_dtypes and n > SMALL_N
        tol = 1e-5 if not tiled else 1e-4 if ks.tile_bits[dtype] == 16 else 2e-2
        assert np.abs(default - exact).max() / scale < tol


def test_matmul_mixed_dtypes_in_one_call():
    a, da = _weight("q8", 20, 64, 1)
    b, db = _weight("f32", 7, 64, 2)
    c, dc = _weight("q4", 11, 64, 3)
    X = RNG.standard_normal((2, 64)).astype(np.float32)
    out = get_kernels("numba-float").matmul([a, b, c], X)
    np.testing.assert_allclose(out, X @ np.concatenate([da, db, dc]).T, rtol=1e-4, atol=1e-4)
    # int8 activations: each matrix of the fused call gives what it gives alone
    ks = get_kernels("numba")
    fused = ks.matmul([a, b, c], X)
    assert np.array_equal(fused, np.concatenate([ks.matmul([w], X) for w in (a, b, c)], axis=1))


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_slices_cross_weights_and_chunk_rows(threads):
    """Prefill matmuls (sgemm path): slices that run from one weight into the next, a
    native f32 weight copied into a tile beside dequantized ones; against float64."""
    import numba

    from cortiq_engine.kernels import fast as fastmod

    ws = [_weight("q8", 150, 64, 1), _weight("f32", 70, 64, 2), _weight("q4", 200, 64, 3), _weight("f32", 300, 64, 4)]
    n = 300
    X = RNG.standard_normal((n, 64)).astype(np.float32)
    exact = X.astype(np.float64) @ np.concatenate([d for _, d in ws]).astype(np.float64).T
    ks = get_kernels("numba-float")
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        spans = fastmod._spans([w for w, _ in ws], numba.get_num_threads())
        out = ks.matmul([w for w, _ in ws], X)
    finally:
        numba.set_num_threads(before)
    # every row of every weight in exactly one piece, in order; slices of at least
    # MIN_SLICE_ROWS except the last, and some crossing a weight boundary
    pieces = [piece for _, _, span in spans for piece in span]
    at = {id(w): 0 for w, _ in ws}
    for w, r0, r1 in pieces:
        assert r0 == at[id(w)] and r1 > r0
        at[id(w)] = r1
    assert all(at[id(w)] == w.rows for w, _ in ws) and len(pieces) > len(spans)
    sizes = [sum(b - a for _, a, b in span) for _, _, span in spans]
    assert [n for _, n, _ in spans] == sizes
    assert [col for col, _, _ in spans] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert all(s >= fastmod.MIN_SLICE_ROWS for s in sizes[:-1])
    assert np.abs(out - exact).max() / np.abs(exact).max() < 1e-5


@pytest.mark.parametrize(
    "rows,cols", [(960, 576), (576, 576), (3072, 576), (576, 1536), (2560, 2048), (49152, 576), (720, 64)]
)
@pytest.mark.parametrize("threads", [2, 3, 4])
def test_prefill_jobs_end_together_on_quiet_threads(rows, cols, threads):
    """The jobs of a prefill matmul: whole 16-row multiples within [MIN_SLICE_ROWS, a tile],
    and no later to finish on quiet threads (rounds of ``threads`` jobs) than the plain
    split by at most 4 jobs a thread; SmolLM2's q|k|v on 2 threads: 6 jobs of 160 rows."""
    from types import SimpleNamespace

    from cortiq_engine.kernels import fast as fastmod

    spans = fastmod._spans([SimpleNamespace(rows=rows, cols=cols)], threads)
    sizes = [n for _, n, _ in spans]
    assert sum(sizes) == rows and all(n % 16 == 0 for n in sizes[:-1])
    most = fastmod._tile_rows(cols) // 16 * 16
    assert all(min(fastmod.MIN_SLICE_ROWS, most) <= n <= most for n in sizes[:-1])
    plain = max(16, min(most, max(fastmod.MIN_SLICE_ROWS, -(-rows // (4 * threads)))) // 16 * 16)
    assert -(-len(sizes) // threads) * sizes[0] <= -(-(-(-rows // plain)) // threads) * plain
    if (rows, cols, threads) == (960, 576, 2):
        assert sizes == [160] * 6


def _attention64(q, kc, vc, start, window, scale, sinks=None):
    """Causal GQA attention in float64, one query and head at a time; a sink joins the
    softmax as one more logit without a value row."""
    n, heads, d = q.shape
    group = heads // kc.shape[0]
    out = np.zeros((n, heads, vc.shape[2]))
    for i in range(n):
        hi = start + i + 1
        lo = max(0, hi - window) if window else 0
        for h in range(heads):
            k = kc[h // group, lo:hi].astype(np.float64)
            s = k @ q[i, h].astype(np.float64) * scale
            logits = s if sinks is None else np.append(s, np.float64(sinks[h]))
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out[i, h] = p[: hi - lo] @ vc[h // group, lo:hi].astype(np.float64)
    return out


def _kernel_sets():
    """Every kernel set, the bare reference included (get_kernels wraps it in RowExact)."""
    from cortiq_engine.kernels import NumpyKernels

    return {"numba": get_kernels("numba"), "numpy": get_kernels("numpy"), "numpy-bare": NumpyKernels()}


# n = 16 and 17 straddle the numba set's switch from its compiled kernel to BLAS blocks.
@pytest.mark.parametrize("n", [1, 5, 16, 17, 30])
@pytest.mark.parametrize("window", [0, 1, 4])
@pytest.mark.parametrize("sinks", [False, True])
def test_attention(n, window, sinks):
    heads, kvh, d, dv, cap, start = 6, 2, 16, 12, 64, 9
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, cap, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, cap, dv)).astype(np.float32)
    sk = (RNG.standard_normal(heads) * 2).astype(np.float32) if sinks else None
    exact = _attention64(q, kc, vc, start, window, d**-0.5, sk)
    call = AttentionCall(d**-0.5, window, sk)
    for name, ks in _kernel_sets().items():
        got = ks.attend(q, kc, vc, start, call)
        np.testing.assert_allclose(got, exact, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("window,sinks", [(0, False), (300, False), (0, True), (700, True)])
def test_attention_over_a_long_cache(window, sinks):
    """Decode and verify rows over 1,000+ keys against float64: the compiled kernel
    splits each query's keys at multiples of jit.ATTN_CHUNK and combines the chunks'
    partial softmaxes; windows that start inside a chunk, sinks, value rows four at a
    time. Row-exact across a chunk boundary: each row alone gives the same bits."""
    from cortiq_engine.kernels import jit

    heads, kvh, d, dv, cap = 8, 2, 64, 48, 1100
    start = 4 * jit.ATTN_CHUNK - 3  # the 7 rows straddle a chunk boundary
    n = 7
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, cap, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, cap, dv)).astype(np.float32)
    sk = (RNG.standard_normal(heads) * 3).astype(np.float32) if sinks else None
    ks = get_kernels("numba")
    exact = _attention64(q, kc, vc, start, window, d**-0.5, sk)
    got = ks.attend(q, kc, vc, start, window, d**-0.5, sk)
    np.testing.assert_allclose(got, exact, atol=2e-6)
    one = np.concatenate([ks.attend(q[i : i + 1].copy(), kc, vc, start + i, window, d**-0.5, sk) for i in range(n)])
    assert np.array_equal(got, one)


def test_vectorized_exp_against_float64():
    from cortiq_engine.kernels import jit

    x = np.concatenate(
        [-np.abs(RNG.standard_normal(20000) * 12), np.linspace(-87, 0, 20001), [0.0, -1e-30, -0.5, -86.9]]
    )
    x = x.astype(np.float32)
    got = np.empty_like(x)
    jit.exp_nonpositive_array(x, got)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 3e-7
    assert got[-4] == 1.0 and got[-3] == 1.0
    below = np.empty(2, np.float32)
    jit.exp_nonpositive_array(np.array([-100.0, -np.float32(1e30)], np.float32), below)
    # clamped at -87: exp(-87) ~ 1.6e-38, tiny and positive, never a denormal, 0 or garbage
    assert np.allclose(below, np.exp(-87.0), rtol=3e-7, atol=0)


def test_sink_softmax_by_hand():
    # One head, two keys, sink s: p = exp([a, b, s]) / sum; out = p0 v0 + p1 v1.
    q = np.array([[[1.0, 0.0]]], np.float32)
    kc = np.array([[[2.0, 0.0], [0.0, 1.0]]], np.float32)
    vc = np.array([[[1.0], [3.0]]], np.float32)
    e = np.exp([2.0, 0.0, 0.5])
    for name, ks in _kernel_sets().items():
        got = ks.attend(q, kc, vc, 1, 0, 1.0, np.array([0.5], np.float32))
        assert got[0, 0, 0] == pytest.approx((e[0] * 1.0 + e[1] * 3.0) / e.sum(), rel=1e-6), name
        # Without the sink the weights sum to one over the keys.
        plain = ks.attend(q, kc, vc, 1, 0, 1.0)
        assert plain[0, 0, 0] == pytest.approx((e[0] * 1.0 + e[1] * 3.0) / (e[0] + e[1]), rel=1e-6), name
    # A sink far above every score takes all the mass without overflowing exp.
    got = get_kernels("numba").attend(q, kc, vc, 1, 0, 1.0, np.array([200.0], np.float32))
    assert np.isfinite(got).all() and abs(got[0, 0, 0]) < 1e-30


def _delta_rule64(q, k, v, g, beta, state):
    """Gated DeltaNet's recurrence in float64, written per head and position."""
    n, hk, dk = q.shape
    hv = v.shape[1]
    S = state.astype(np.float64).copy()
    o = np.zeros(v.shape)
    for t in range(n):
        for h in range(hv):
            kh = h // (hv // hk)
            kt, qt = k[t, kh].astype(np.float64), q[t, kh].astype(np.float64)
            S[h] *= np.exp(np.float64(g[t, h]))
            delta = (v[t, h] - kt @ S[h]) * np.float64(beta[t, h])
            S[h] += np.outer(kt, delta)
            o[t, h] = qt @ S[h]
    return o, S


@pytest.mark.parametrize("n", [1, 7])
def test_delta_rule(n):
    rng = np.random.default_rng(n)
    hk, hv, dk, dv = 2, 4, 8, 6
    q = (rng.standard_normal((n, hk, dk)) * 0.3).astype(np.float32)
    k = (rng.standard_normal((n, hk, dk)) * 0.3).astype(np.float32)
    v = rng.standard_normal((n, hv, dv)).astype(np.float32)
    g = -rng.random((n, hv)).astype(np.float32)
    beta = rng.random((n, hv)).astype(np.float32)
    s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32)
    want_o, want_s = _delta_rule64(q, k, v, g, beta, s0)
    for name, ks in _kernel_sets().items():
        keep = s0.copy()
        o, s = ks.delta_rule(q, k, v, g, beta, s0)
        assert np.array_equal(s0, keep), name  # the state passed in is not modified
        np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5, err_msg=name)


# ------------------------------------------------------------------ row-exactness
@pytest.mark.parametrize("name", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", ["q8", "q4", "f16", "bf16", "f32"])
def test_declared_row_exact_matmul(name, dtype):
    """Up to ``row_exact_rows``, a k-row matmul gives every row bit for bit its 1-row result."""
    ks = get_kernels(name)
    assert ks.row_exact_rows >= 8
    cols = 96 if dtype in ("q8", "q4") else 70
    ws = [_weight(dtype, r, cols, seed=i)[0] for i, r in enumerate((50, 17, 33))]
    X = RNG.standard_normal((ks.row_exact_rows, cols)).astype(np.float32)
    one = np.concatenate([ks.matmul(ws, X[i : i + 1].copy()) for i in range(X.shape[0])])
    for k in sorted({2, 3, 5, ks.row_exact_rows}):
        assert np.array_equal(ks.matmul(ws, X[:k].copy()), one[:k]), k


@pytest.mark.parametrize("name", ["numba", "numpy"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_declared_row_exact_attend(name, window, sinks):
    ks = get_kernels(name)
    heads, kvh, d, dv, start = 4, 2, 16, 8, 20
    k = ks.row_exact_rows
    q = RNG.standard_normal((k, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, 64, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, 64, dv)).astype(np.float32)
    sk = RNG.standard_normal(heads).astype(np.float32) if sinks else None
    call = AttentionCall(0.25, window, sk)
    one = np.concatenate([ks.attend(q[i : i + 1].copy(), kc, vc, start + i, call) for i in range(k)])
    assert np.array_equal(ks.attend(q, kc, vc, start, call), one)


@pytest.mark.parametrize("n", [1, 4, 16, 17])
def test_attention_call_forms(n):
    """Every set gives the same bits for an ``AttentionCall`` and for its positional form
    (window, scale, sinks), and for a capped call the bits of ``softcap_attend``."""
    heads, kvh, d, dv, start = 6, 2, 16, 8, 30
    q = RNG.standard_normal((n, heads, d)).astype(np.float32)
    kc = RNG.standard_normal((kvh, 64, d)).astype(np.float32)
    vc = RNG.standard_normal((kvh, 64, dv)).astype(np.float32)
    sk = RNG.standard_normal(heads).astype(np.float64)  # any float type: the record makes it f32
    capped = softcap_attend(q, kc, vc, start, 5, 0.25, 2.0, sk)
    for name, ks in _kernel_sets().items():
        want = ks.attend(q, kc, vc, start, AttentionCall(0.25, 5, sk))
        assert np.array_equal(ks.attend(q, kc, vc, start, 5, 0.25, sk), want), name
        assert np.array_equal(ks.attend(q, kc, vc, start, AttentionCall(0.25, 5, sk, softcap=2.0)), capped), name


def test_row_exact_wrapper():
    """``RowExact`` raises a set's declared rows and keeps every other operation its own."""
    from cortiq_engine.kernels import NumpyKernels, RowExact

    bare = NumpyKernels()
    assert bare.row_exact_rows == 1
    rx = RowExact(bare, 6)
    assert rx.row_exact_rows == 6 and rx.name == "numpy" and rx.rms_norm == bare.rms_norm
    w = _weight("f32", 300, 256)[0]
    X = RNG.standard_normal((7, 256)).astype(np.float32)
    one = np.concatenate([bare.matmul([w], X[i : i + 1].copy()) for i in range(7)])
    assert np.array_equal(rx.matmul([w], X[:6]), one[:6])
    # Past its rows (prefill) the call goes to the inner set as one batch.
    assert np.array_equal(rx.matmul([w], X), bare.matmul([w], X))
    # A wrapper never lowers what the inner set declares.
    assert RowExact(get_kernels("numba"), 2).row_exact_rows == get_kernels("numba").row_exact_rows


@pytest.mark.parametrize("n", [1, 16, 17, 64])
def test_glu_activations_against_float64(n):
    """silu(g) * u and the tanh GELU(g) * u, decode sizes and prefill sizes (n > small_n:
    rows in parallel on the vectorized exp), against float64; gates of either sign far
    into the tails (no overflow, no NaN)."""
    ks = get_kernels("numba")
    rng = np.random.default_rng(n)
    gu = (rng.standard_normal((n, 192)) * 6).astype(np.float32)
    gu[0, :6] = [0.0, 95.0, -95.0, 1e-7, -1e-7, 30.0]
    g, u = gu[:, :96].astype(np.float64), gu[:, 96:].astype(np.float64)
    silu = g / (1 + np.exp(-g)) * u
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
    for got, want in ((ks.silu_mul(gu), silu), (ks.gelu_tanh_mul(gu), gelu)):
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
        big = np.abs(want) > 1e-3 * np.abs(want).max()
        assert (np.abs(got - want)[big] / np.abs(want)[big]).max() < 2e-6


def test_small_glu_rows_are_row_exact():
    """A decode's and a verify's activation (``jit.glu_small``, up to 16 rows): each row's
    bits are its one-row result, whatever the rows beside it (speculative == greedy)."""
    from cortiq_engine.kernels import jit

    gu = (np.random.default_rng(3).standard_normal((16, 256)) * 4).astype(np.float32)
    for gelu in (True, False):
        rows = np.empty((16, 128), np.float32)
        jit.glu_small(gu, rows, gelu)
        for i in range(16):
            one = np.empty((1, 128), np.float32)
            jit.glu_small(gu[i : i + 1], one, gelu)
            assert np.array_equal(one[0], rows[i])


def test_norms_rope_silu():
    fast, ref = get_kernels("numba"), get_kernels("numpy")
    x = RNG.standard_normal((5, 40)).astype(np.float32)
    w = RNG.standard_normal(40).astype(np.float32)
    exact = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6)
    for ks in (fast, ref):
        np.testing.assert_allclose(ks.rms_norm(x, w, 1e-6), exact, rtol=1e-5, atol=1e-6)
        x1, d = x.copy(), RNG.standard_normal((5, 40)).astype(np.float32)
        got = ks.add_rms_norm(x1, d, w, 1e-6)
        np.testing.assert_allclose(x1, x + d, rtol=1e-6)
        np.testing.assert_allclose(got, ref.rms_norm(x + d, w, 1e-6), rtol=1e-5, atol=1e-6)
        gu = RNG.standard_normal((3, 8)).astype(np.float32)
        g, u = gu[:, :4].astype(np.float64), gu[:, 4:]
        np.testing.assert_allclose(ks.silu_mul(gu), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
        # rope: rotating by the angle of position p twice equals rotating by 2p (per pair).
        xr = RNG.standard_normal((2, 3, 8)).astype(np.float32)
        ang = np.array([[0.3, 1.1, 0.0, 2.0], [0.5, 0.25, 1.0, 3.0]], np.float32)
        y = xr.copy()
        ks.rope(y, np.cos(ang), np.sin(ang))
        a, b = xr[..., :4], xr[..., 4:]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        np.testing.assert_allclose(y, np.concatenate([a * c - b * s, b * c + a * s], -1), rtol=1e-5, atol=1e-6)
