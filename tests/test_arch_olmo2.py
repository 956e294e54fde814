"""OLMo 2 on tiny random checkpoints (fast, for CI): the engine against transformers'
Olmo2ForCausalLM (post-sublayer norms only, q/k RMS norms over the whole projection
width), and the full-width q/k norm shown to differ from a per-head one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from formats.arch import LAYER_FULL
from formats.errors import CortiqError
from cortiq_engine import Engine, SamplingConfig
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.models import parse_config
from tests import arch_tiny
from tests.tiny import build_tiny

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=1,
)
N_IDS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo2")
    model = build_tiny("olmo2", **TINY)
    src = arch_tiny.save(model, root / "hf")
    cmf = root / "o.cmf"
    convert_checkpoint(src, cmf, quant="f32")
    return model, src, cmf


def test_arch_parsed_from_config(tiny):
    cfg = json.loads((tiny[1] / "config.json").read_text())
    arch = parse_config(cfg)
    assert arch.arch == "olmo2" and arch.norm_style == "rms" and not arch.qk_norm
    assert arch.layer_types == [LAYER_FULL] * 3 and arch.head_dim == 16 and arch.norm_eps == 1e-5
    assert parse_config({k: v for k, v in cfg.items() if k != "rms_norm_eps"}).norm_eps == 1e-5  # Olmo2Config's default
    with pytest.raises(CortiqError, match="activation 'gelu'"):
        parse_config({**cfg, "hidden_act": "gelu"})


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny, kernels):
    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(N_IDS, vocab=300)
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    err = arch_tiny.rel_err(got, ref)
    assert err < 1e-4, err


def test_greedy_decode_matches_transformers(tiny):
    """16 greedy tokens one at a time (the small-batch route) equal transformers' generate."""
    import torch

    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(8, seed=3, vocab=300)
    with Engine.load(cmf) as eng:
        got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=16, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 8:].tolist()
    assert got == ref


def test_q8_conversion_stays_close(tiny, tmp_path):
    model, src, _ = tiny
    out = tmp_path / "q8.cmf"
    convert_checkpoint(src, out, quant="q8")
    ids = arch_tiny.sample_ids(N_IDS, vocab=300)
    with Engine.load(out) as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 0.05


def test_full_width_qk_norm_is_not_per_head():
    """Attention(qk_norm_full=True) norms q and k over all heads at once, before the
    split into heads (as Olmo2Attention does); per-head norms give other rows; a norm
    of the wrong width is refused."""
    from cortiq_engine.cache import KVCache
    from cortiq_engine.kernels import get_kernels
    from cortiq_engine.layers import Attention, AttentionWeights, Step
    from cortiq_engine.weights import Weight

    rng = np.random.default_rng(0)
    nh, nkv, hd, h, n, eps = 4, 2, 8, 32, 3, 1e-6
    ks = get_kernels("numpy")

    def w(rows, cols, name):
        a = rng.normal(0, 0.3, (rows, cols)).astype(np.float32)
        a[: rows // 2] *= 4  # heads of different sizes: the two kinds of norm disagree
        return a, Weight(name, "f32", rows, cols, {"data": a})

    (qa, q), (ka, k), (va, v), (oa, o) = w(nh * hd, h, "q"), w(nkv * hd, h, "k"), w(nkv * hd, h, "v"), w(h, nh * hd, "o")
    qn = (1.0 + rng.normal(0, 0.1, nh * hd)).astype(np.float32)
    kn = (1.0 + rng.normal(0, 0.1, nkv * hd)).astype(np.float32)
    x = rng.normal(0, 1, (n, h)).astype(np.float32)

    def by_hand(width_q: int, width_k: int) -> np.ndarray:
        def rms(a, wn, width):
            r = a.reshape(-1, width)
            return (r / np.sqrt((r**2).mean(-1, keepdims=True) + eps)).reshape(a.shape) * wn

        qf, kf, vf = rms(x @ qa.T, qn, width_q), rms(x @ ka.T, kn, width_k), x @ va.T
        cache = KVCache(nkv, hd, hd, 8)
        start = cache.append(kf.reshape(n, nkv, hd).astype(np.float32), vf.reshape(n, nkv, hd).astype(np.float32))
        att = ks.attend(qf.reshape(n, nh, hd).astype(np.float32), cache.keys, cache.values, start, 0, hd**-0.5)
        return att.reshape(n, nh * hd) @ oa.T

    def attention(qnorm=qn):
        return Attention(ks, AttentionWeights(q, k, v, o, q_norm=qnorm, k_norm=kn), num_heads=nh, num_kv_heads=nkv,
                         head_dim=hd, v_head_dim=hd, rope=None, norm_eps=eps, qk_norm_full=True)

    full = attention()
    got = full(x, full.make_cache(8), Step(np.arange(n)))
    want, per_head = by_hand(nh * hd, nkv * hd), by_hand(hd, hd)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.abs(per_head - want).max() > 1e-2 * np.abs(want).max()
    with pytest.raises(CortiqError, match="q_norm has 8 values, the attention geometry needs 32"):
        attention(qn[:hd])
