"""Sliding-window attention with learned sinks and a narrower V head (MiMo-V2).

Oracles: a plainly written numpy softmax over [scores, sink] (hand-checked on a
two-key case), and transformers' own ``MiMoV2FlashAttention`` on random weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine.cache import KVCache
from cortiq_engine.kernels import get_kernels
from cortiq_engine.layers import AttentionWeights, RoPE, Step
from cortiq_engine.sink_attention import SinkAttention, attend_sinks, attend_sinks_reference
from cortiq_engine.weights import Weight


def _w(name: str, a: np.ndarray) -> Weight:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return Weight(name, "f32", a.shape[0], a.shape[1], {"data": a})


def test_sink_softmax_by_hand():
    # One head, two keys, sink s: p = exp([a, b, s]) / sum; out = p0 v0 + p1 v1.
    q = np.array([[[1.0, 0.0]]], np.float32)
    kc = np.array([[[2.0, 0.0], [0.0, 1.0]]], np.float32)
    vc = np.array([[[1.0], [3.0]]], np.float32)
    sink = np.array([0.5], np.float32)
    e = np.exp([2.0, 0.0, 0.5])
    want = (e[0] * 1.0 + e[1] * 3.0) / e.sum()
    got_ref = attend_sinks_reference(q, kc, vc, 1, 0, 1.0, sink)
    got = attend_sinks(q, kc, vc, 1, 0, 1.0, sink)
    assert got_ref[0, 0, 0] == pytest.approx(want, rel=1e-6)
    assert got[0, 0, 0] == pytest.approx(want, rel=1e-6)
    # Without the sink the weights sum to one over the keys.
    plain = (e[0] * 1.0 + e[1] * 3.0) / (e[0] + e[1])
    assert attend_sinks(q, kc, vc, 1, 0, 1.0, None)[0, 0, 0] == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("window", [0, 1, 3, 7])
def test_compiled_matches_reference_and_plain_kernel(window):
    rng = np.random.default_rng(window)
    n, heads, kvh, d, dv, start = 5, 4, 2, 12, 8, 6
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    kc = rng.standard_normal((kvh, 16, d)).astype(np.float32)
    vc = rng.standard_normal((kvh, 16, dv)).astype(np.float32)
    sinks = rng.standard_normal(heads).astype(np.float32) * 2
    ref = attend_sinks_reference(q, kc, vc, start, window, 0.3, sinks)
    np.testing.assert_allclose(attend_sinks(q, kc, vc, start, window, 0.3, sinks), ref, rtol=1e-5, atol=1e-6)
    # sinks=None is exactly the engine's plain attention.
    plain = get_kernels("numpy").attend(q, kc, vc, start, window, 0.3)
    np.testing.assert_allclose(attend_sinks(q, kc, vc, start, window, 0.3, None), plain, rtol=1e-5, atol=1e-6)
    # Row by row gives the batch's numbers bit for bit (decode == batched verify).
    rows = np.concatenate([attend_sinks(q[i : i + 1], kc, vc, start + i, window, 0.3, sinks) for i in range(n)])
    assert np.array_equal(rows, attend_sinks(q, kc, vc, start, window, 0.3, sinks))


def _mimo_attention(window: int):
    import torch
    from transformers import AutoConfig
    from transformers.models.mimo_v2_flash import modeling_mimo_v2_flash as mm

    cfg = AutoConfig.for_model(
        "mimo_v2_flash", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, sliding_window=window,
        layer_types=["full_attention", "sliding_attention"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, max_position_embeddings=128,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = mm.MiMoV2FlashAttention(cfg, 1).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    rot = mm.MiMoV2FlashRotaryEmbedding(cfg)
    return cfg, attn, rot


@pytest.mark.parametrize("window", [4, 200])
def test_matches_transformers_mimo_v2_flash_attention(window):
    torch = pytest.importorskip("torch")
    cfg, attn, rot = _mimo_attention(window)
    n = 11
    torch.manual_seed(1)
    x = torch.randn(1, n, cfg.hidden_size)
    pos = torch.arange(n)[None]
    cos, sin = rot(x, pos, "sliding_attention")
    i = torch.arange(n)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        want = attn(x, (cos, sin), attention_mask=mask)[0][0].numpy()

    sd = {k: v.detach().numpy() for k, v in attn.state_dict().items()}
    nkv = attn.k_proj.weight.shape[0] // attn.head_dim
    rd = cos.shape[-1]
    theta = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    xs = x[0].numpy()
    for ks_name in ("numpy", "numba"):
        ks = get_kernels(ks_name)
        mine = SinkAttention(
            ks,
            AttentionWeights(_w("q", sd["q_proj.weight"]), _w("k", sd["k_proj.weight"]),
                             _w("v", sd["v_proj.weight"]), _w("o", sd["o_proj.weight"])),
            num_heads=cfg.num_attention_heads, num_kv_heads=nkv, head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim, rope=RoPE(rd, theta), norm_eps=1e-6, window=window,
            sinks=sd["sinks"], v_scale=cfg.attention_value_scale,
        )
        # Prefill of 6 rows, then one row at a time: the cache carries the window.
        cache = KVCache(nkv, cfg.head_dim, cfg.v_head_dim, 32)
        outs = [mine(xs[:6].copy(), cache, Step(np.arange(0, 6)))]
        for p in range(6, n):
            outs.append(mine(xs[p : p + 1].copy(), cache, Step(np.arange(p, p + 1))))
        got = np.concatenate(outs)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, (ks_name, err)
    # The sinks matter: dropping them changes the output.
    mine.sinks = None
    cache = KVCache(nkv, cfg.head_dim, cfg.v_head_dim, 32)
    assert np.abs(mine(xs.copy(), cache, Step(np.arange(n))) - want).max() > 1e-3
