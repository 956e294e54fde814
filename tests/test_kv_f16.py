"""The f16 KV cache (``Engine.load(kv_cache="f16")``, ``--kv-cache f16``).

A key or value is rounded to f16 once, as it enters the cache; every kernel then reads
the f16 bits widened to f32, which is exact. So each attention route on an f16 cache
must give, bit for bit, what it gives on an f32 cache holding the same rounded values:
the IR decode loops (which read the halves themselves), the prefill's blocks, the
numba loops and the reference kernels (which read a widened copy). The rounding's own
effect on a real model is measured against the f32 cache (KL, top-1), and the
speculative contract (speculative == plain greedy) holds within f16 mode.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine.cache import F16_MAX, KVCache
from cortiq_engine.kernels import attn_ir, qdot
from cortiq_engine.kernels.fast import NumbaKernels
from cortiq_engine.kernels.reference import NumpyKernels
from formats.errors import CortiqError
from tests.attn_calls import scores as _scores, values as _values

RNG = np.random.default_rng(5)
HAS_IR = qdot.host_supports()


def test_a_row_is_rounded_once_as_it_enters():
    c = KVCache(2, 16, 8, 10, np.float16)
    k = RNG.standard_normal((3, 2, 16)).astype(np.float32)
    v = RNG.standard_normal((3, 2, 8)).astype(np.float32)
    assert c.append(k, v) == 0
    assert c.keys.dtype == c.values.dtype == np.float16
    assert np.array_equal(c.keys[:, :3], k.astype(np.float16).transpose(1, 0, 2))
    assert np.array_equal(c.values[:, :3], v.astype(np.float16).transpose(1, 0, 2))
    assert c.keys.nbytes == 2 * 10 * 16 * 2  # half of f32's


def test_a_value_beyond_f16_is_refused_not_stored_as_inf():
    c = KVCache(1, 16, 16, 4, np.float16)
    k = np.zeros((1, 1, 16), np.float32)
    v = np.zeros((1, 1, 16), np.float32)
    v[0, 0, 3] = -2 * F16_MAX
    with pytest.raises(CortiqError, match="exceeds f16's range") as e:
        c.append(k, v)
    assert "\n" not in str(e.value) and c.length == 0
    v[0, 0, 3] = F16_MAX  # the largest finite half is stored as itself
    c.append(k, v)
    assert c.values[0, 0, 3] == np.float16(F16_MAX)


def test_an_unknown_cache_type_is_a_one_line_error(tmp_path):
    from cortiq_engine import Engine

    with pytest.raises(CortiqError, match="unknown --kv-cache 'f8'"):
        Engine.load(tmp_path / "absent.cmf", kv_cache="f8")  # refused before the file is opened


@pytest.mark.skipif(not HAS_IR, reason="the IR loops need x86-64 AVX2/FMA")
@pytest.mark.parametrize("layout", [attn_ir.WIDE, attn_ir.NARROW], ids=["wide", "narrow"])
def test_the_ir_loops_read_halves_as_their_widening(layout):
    """attn_scores/attn_values compiled for an f16 cache give the f32 loops' bits on
    the widened values, for every group size and key counts around the passes."""
    f32 = attn_ir.AttentionLoops(layout=layout).addrs
    f16 = attn_ir.AttentionLoops(layout=layout, kv="f16").addrs
    assert (f16 != 0).all() and (f16[:2] != f32[:2]).all()
    for g in range(1, attn_ir.MAX_GROUP + 1):
        for m in (1, 5, 16, 33):
            q = RNG.standard_normal((g, 64)).astype(np.float32)
            kh = RNG.standard_normal((m, 64)).astype(np.float16)
            s16, s32 = np.zeros((g, 40), np.float32), np.zeros((g, 40), np.float32)
            _scores(f16[0], g, q, kh.view(np.uint16), m, np.float32(0.125), s16)
            _scores(f32[0], g, q, kh.astype(np.float32), m, np.float32(0.125), s32)
            assert np.array_equal(s16, s32), (g, m)
            p = RNG.random((g, 40)).astype(np.float32)
            vh = RNG.standard_normal((m, 48)).astype(np.float16)
            o16, o32 = np.zeros((g, 48), np.float32), np.zeros((g, 48), np.float32)
            _values(f16[1], g, p, vh.view(np.uint16), m, o16)
            _values(f32[1], g, p, vh.astype(np.float32), m, o32)
            assert np.array_equal(o16, o32), (g, m)
            exact = p[:, :m].astype(np.float64) @ vh.astype(np.float64)
            np.testing.assert_allclose(o16, exact, rtol=0, atol=2e-6 * np.sqrt(m))


def _caches(kvh, cap, d, dv, length):
    k = np.zeros((kvh, cap, d), np.float16)
    v = np.zeros((kvh, cap, dv), np.float16)
    k[:, :length] = RNG.standard_normal((kvh, length, d))
    v[:, :length] = RNG.standard_normal((kvh, length, dv))
    return k, v


KERNELS = {"numba": NumbaKernels(), "numba-loops": NumbaKernels(attn_loops=False), "numpy": NumpyKernels()}


@pytest.mark.parametrize("kernels", list(KERNELS))
@pytest.mark.parametrize("heads,kvh,d,dv", [(8, 2, 64, 64), (4, 1, 256, 256), (6, 3, 24, 16)])
@pytest.mark.parametrize("window,sinks", [(0, False), (37, True)])
def test_every_route_on_an_f16_cache_equals_the_f32_cache_of_its_values(kernels, heads, kvh, d, dv, window, sinks):
    """Decode (1 row), verify (4 rows: each row its one-row result) and prefill (40 rows,
    the blocks) on an f16 cache against the f32 cache holding the same halves. Head sizes
    the IR serves (64, 256) and one it does not (24/16: the widened copy)."""
    ks = KERNELS[kernels]
    start = 90
    kh, vh = _caches(kvh, 200, d, dv, start + 40)
    k32, v32 = kh.astype(np.float32), vh.astype(np.float32)
    sk = RNG.standard_normal(heads).astype(np.float32) if sinks else None
    for n in (1, 4, 40):
        q = RNG.standard_normal((n, heads, d)).astype(np.float32)
        got = ks.attend(q, kh, vh, start, window, 0.125, sk)
        want = ks.attend(q, k32, v32, start, window, 0.125, sk)
        assert got.dtype == np.float32 and np.array_equal(got, want), n
        if n == 4 and kernels != "numpy":
            for i in range(n):
                one = ks.attend(q[i : i + 1].copy(), kh, vh, start + i, window, 0.125, sk)
                assert np.array_equal(one[0], got[i]), i


@pytest.fixture(scope="module")
def smol_pair(smollm2_cmf):
    from cortiq_engine import Engine

    path = smollm2_cmf("q8")
    with Engine.load(path, threads=2) as f32, Engine.load(path, threads=2, kv_cache="f16") as f16:
        yield f32, f16


def test_smollm2_f16_cache_against_the_f32_cache(smol_pair, english_text):
    """What the rounding costs on a real model: 512 tokens of real text, the f16 cache's
    next-token distributions against the f32 cache's (measured on SmolLM2 q8: mean KL
    1.2e-6 nats, max 8e-5, top-1 the same at every position)."""
    f32, f16 = smol_pair
    assert f16.model.kv_cache == "f16" and f16.new_state(8).caches[0].keys.dtype == np.float16
    ids = f32.tokenizer.encode(english_text)[:512]
    a = f32.logits(ids).astype(np.float64)
    b = f16.logits(ids).astype(np.float64)
    assert not np.array_equal(a, b)  # the rounding is real
    pa = np.exp(a - a.max(1, keepdims=True))
    pa /= pa.sum(1, keepdims=True)
    lb = b - b.max(1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(1, keepdims=True))
    kl = (pa * (np.log(pa + 1e-300) - lb)).sum(1)
    assert kl.mean() < 1e-4 and kl.max() < 1e-2
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.99


def test_smollm2_f16_cache_decodes_the_prefill_it_wrote(smol_pair, english_text):
    """Prefill then 24 decode steps on the f16 cache equal teacher forcing the same
    tokens through the f16 cache (every token enters the cache once, as f16)."""
    _, f16 = smol_pair
    prompt = f16.tokenizer.encode(english_text[:400])
    res = f16.generate(prompt, max_tokens=24, ignore_eos=True, speculative=False)
    logits = f16.logits(prompt + res.token_ids[:-1])
    assert list(logits[len(prompt) - 1 :].argmax(1)) == res.token_ids
