"""The one attention block (``layers.Attention``) with each of its options, against
transformers' own attention modules on random weights: MiMo-V2's sliding window with
learned sinks, a narrower V head and a V scale; Qwen3-Next's output gate with q/k
norms and partial rotary. (The kernels' ``attend(..., sinks=)`` against float64 math:
tests/test_engine_kernels.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cortiq_engine.cache import KVCache
from cortiq_engine.kernels import get_kernels
from cortiq_engine.layers import Attention, AttentionWeights, RoPE, Step
from formats.errors import CortiqError
from cortiq_engine.weights import Weight


def _w(name: str, a: np.ndarray) -> Weight:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return Weight(name, "f32", a.shape[0], a.shape[1], {"data": a})


def _torch_attention(model_type: str, module: str, prefix: str, **config):
    """transformers' attention module of layer 1 of a tiny ``model_type`` with random
    weights, its config and its rotary embedding."""
    import importlib

    import torch
    from transformers import AutoConfig

    mm = importlib.import_module(f"transformers.models.{model_type}.{module}")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        moe_intermediate_size=32,
        max_position_embeddings=128,
        **config,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = getattr(mm, f"{prefix}Attention")(cfg, 1).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
    return cfg, attn, getattr(mm, f"{prefix}RotaryEmbedding")(cfg)


def _mimo_attention(window: int):
    return _torch_attention(
        "mimo_v2_flash",
        "modeling_mimo_v2_flash",
        "MiMoV2Flash",
        num_key_value_heads=1,
        head_dim=24,
        v_head_dim=16,
        sliding_window=window,
        layer_types=["full_attention", "sliding_attention"],
        n_routed_experts=4,
        num_experts_per_tok=2,
    )


@pytest.mark.parametrize("window", [4, 200])
def test_matches_transformers_mimo_v2_flash_attention(window):
    import torch

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
        mine = Attention(
            ks,
            AttentionWeights(
                _w("q", sd["q_proj.weight"]),
                _w("k", sd["k_proj.weight"]),
                _w("v", sd["v_proj.weight"]),
                _w("o", sd["o_proj.weight"]),
            ),
            num_heads=cfg.num_attention_heads,
            num_kv_heads=nkv,
            head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim,
            rope=RoPE(rd, theta),
            norm_eps=1e-6,
            window=window,
            sinks=sd["sinks"],
            v_scale=cfg.attention_value_scale,
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
    mine.call = dataclasses.replace(mine.call, sinks=None)
    cache = KVCache(nkv, cfg.head_dim, cfg.v_head_dim, 32)
    assert np.abs(mine(xs.copy(), cache, Step(np.arange(n))) - want).max() > 1e-3


def _qwen3_next_attention():
    return _torch_attention(
        "qwen3_next",
        "modeling_qwen3_next",
        "Qwen3Next",
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
    )


def test_matches_transformers_qwen3_next_gated_attention():
    """Output gate in q_proj, (1 + w) q/k norms, rotary on a quarter of head_dim."""
    import torch

    cfg, attn, rot = _qwen3_next_attention()
    n = 9
    torch.manual_seed(1)
    x = torch.randn(1, n, cfg.hidden_size)
    cos, sin = rot(x, torch.arange(n)[None])
    mask = torch.triu(torch.full((n, n), float("-inf")), 1)[None, None]
    with torch.no_grad():
        want = attn(x, (cos, sin), attention_mask=mask)[0][0].numpy()
    sd = {k: v.detach().numpy() for k, v in attn.state_dict().items()}
    hd, nkv = cfg.head_dim, cfg.num_key_value_heads
    theta = cfg.rope_parameters["rope_theta"]
    w = AttentionWeights(
        _w("q", sd["q_proj.weight"]),
        _w("k", sd["k_proj.weight"]),
        _w("v", sd["v_proj.weight"]),
        _w("o", sd["o_proj.weight"]),
        q_norm=sd["q_norm.weight"] + 1.0,
        k_norm=sd["k_norm.weight"] + 1.0,
    )
    xs = x[0].numpy()
    for ks_name in ("numpy", "numba"):
        mine = Attention(
            get_kernels(ks_name),
            w,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=nkv,
            head_dim=hd,
            v_head_dim=hd,
            rope=RoPE(cos.shape[-1], theta),
            norm_eps=cfg.rms_norm_eps,
            output_gate=True,
        )
        cache = mine.make_cache(32)
        outs = [mine(xs[:5].copy(), cache, Step(np.arange(0, 5)))]
        outs += [mine(xs[p : p + 1].copy(), cache, Step(np.arange(p, p + 1))) for p in range(5, n)]
        err = np.abs(np.concatenate(outs) - want).max() / np.abs(want).max()
        assert err < 1e-5, (ks_name, err)
    # Without the gate q_proj's rows do not fit the geometry: refused, not misread.
    with pytest.raises(CortiqError, match="geometry"):
        Attention(
            get_kernels("numpy"),
            w,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=nkv,
            head_dim=hd,
            v_head_dim=hd,
            rope=RoPE(cos.shape[-1], theta),
            norm_eps=cfg.rms_norm_eps,
        )


def test_refuses_bad_sinks():
    a = np.ones((8, 8), np.float32)
    w = AttentionWeights(_w("q", a), _w("k", a[:4]), _w("v", a[:4]), _w("o", a))
    geo = dict(num_heads=2, num_kv_heads=1, head_dim=4, v_head_dim=4, rope=RoPE(4, 10000.0), norm_eps=1e-6)
    for sinks, msg in ((np.zeros(3), "3 attention sinks for 2 heads"), (np.array([0.0, np.nan]), "non-finite")):
        with pytest.raises(CortiqError, match=msg):
            Attention(get_kernels("numpy"), w, sinks=sinks, **geo)
