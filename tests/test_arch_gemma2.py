"""Gemma 2 on tiny random checkpoints (fast, for CI): the engine against transformers'
Gemma2ForCausalLM with attention and final soft-caps small enough to bite (each shown
to change the logits), mixed sliding / global layers with a window of 6 (shown to
matter), and the f32 attention soft-cap kernel against float64 math.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from formats.arch import LAYER_FULL, LAYER_SLIDING
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
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    sliding_window=6,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
# q/k weights scaled up so raw scores reach past the cap of 5, and the (tied) embedding
# so logits reach past the final cap of 3: at the init's 0.02 both stay near 0, where
# tanh is the identity and a cap could not be seen.
QK_GAIN = 8.0
EMBED_GAIN = 8.0
N_IDS = 24


def build(**over):
    import torch

    model = build_tiny("gemma2", **{**TINY, **over})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_GAIN)
        model.model.embed_tokens.weight.mul_(EMBED_GAIN)
    return model


def _convert(src: Path, cmf: Path, quant: str = "f32") -> Path:
    convert_checkpoint(src, cmf, quant=quant)
    return cmf


def _variant(root: Path, src: Path, name: str, **cfg_over) -> Path:
    """The same weights under a config.json with ``cfg_over``, converted to f32."""
    dst = root / name
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **cfg_over}))
    return _convert(dst, root / f"{name}.cmf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    model = build()
    src = arch_tiny.save(model, root / "hf")
    return model, src, _convert(src, root / "g.cmf"), root


def test_arch_parsed_from_config(tiny):
    arch = parse_config(json.loads((tiny[1] / "config.json").read_text()))
    assert arch.arch == "gemma2" and arch.norm_style == "rms_one" and not arch.qk_norm
    assert arch.layer_types == [LAYER_SLIDING, LAYER_FULL, LAYER_SLIDING, LAYER_SLIDING]
    assert (arch.query_pre_attn_scalar, arch.sliding_window) == (24, 6)
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (5.0, 3.0)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.tie_word_embeddings


def test_default_layer_pattern_and_refusals(tiny):
    cfg = json.loads((tiny[1] / "config.json").read_text())
    arch = parse_config({**cfg, "layer_types": None, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert arch.layer_types == [LAYER_SLIDING, LAYER_FULL] * 2  # transformers' default: even layers slide
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (0.0, 0.0)
    with pytest.raises(CortiqError, match="use_bidirectional_attention"):
        parse_config({**cfg, "use_bidirectional_attention": True})
    with pytest.raises(CortiqError, match="layer_types"):
        parse_config({**cfg, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(CortiqError, match="sliding_window"):
        parse_config({**cfg, "sliding_window": None})


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny, kernels):
    model, _, cmf, _ = tiny
    ids = arch_tiny.sample_ids(N_IDS, vocab=300)  # 24 > the window of 6: the local layers forget
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert np.abs(ref).max() <= 3.0 + 1e-6  # the final soft cap is in play
    err = arch_tiny.rel_err(got, ref)
    assert err < 1e-4, err


@pytest.mark.parametrize(
    "name,over",
    [
        ("no_attn_cap", {"attn_logit_softcapping": None}),
        ("no_final_cap", {"final_logit_softcapping": None}),
        ("wide_window", {"sliding_window": 64}),
    ],
)
def test_caps_and_window_matter(tiny, name, over):
    """Each of the attention cap, the final cap and the window changes the logits well
    beyond the tolerance, and the engine still matches transformers without it."""
    model, src, cmf, root = tiny
    ids = arch_tiny.sample_ids(N_IDS, vocab=300)
    other = _variant(root, src, name, **over)
    with Engine.load(cmf, kernels="numpy") as eng:
        base = eng.logits(ids)
    with Engine.load(other, kernels="numpy") as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, base) > 1e-2
    ref_model = build(**over)
    assert arch_tiny.rel_err(got, arch_tiny.torch_logits(ref_model, ids)) < 1e-4


def test_greedy_decode_matches_transformers(tiny):
    """16 greedy tokens one at a time (the small-batch route) equal transformers' generate."""
    import torch

    model, _, cmf, _ = tiny
    ids = arch_tiny.sample_ids(8, seed=3, vocab=300)
    with Engine.load(cmf) as eng:
        got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=16, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 8:].tolist()
    assert got == ref


def test_q8_conversion_stays_close(tiny, tmp_path):
    model, src, _, _ = tiny
    out = _convert(src, tmp_path / "q8.cmf", quant="q8")
    ids = arch_tiny.sample_ids(N_IDS, vocab=300)
    with Engine.load(out) as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 0.05


def test_softcap_attend_matches_float64():
    """reference.softcap_attend (GQA, window, a cache longer than the rows in use) against
    float64 math: scale, cap * tanh(s / cap), then the causal/window mask, softmax."""
    from cortiq_engine.kernels.reference import softcap_attend

    rng = np.random.default_rng(1)
    heads, kv, d, n, start, cap, window = 4, 2, 16, 5, 7, 5.0, 6
    q = rng.normal(0, 3, (n, heads, d)).astype(np.float32)
    kc = rng.normal(0, 3, (kv, 32, d)).astype(np.float32)
    vc = rng.normal(0, 1, (kv, 32, d)).astype(np.float32)
    scale = 24**-0.5
    got = softcap_attend(q, kc, vc, start, window, scale, cap)
    want = np.empty((n, heads, d))
    for i in range(n):
        pos = start + i
        lo = max(0, pos - window + 1)
        for h in range(heads):
            g = h // (heads // kv)
            s = kc[g, lo : pos + 1].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            s = cap * np.tanh(s / cap)
            p = np.exp(s - s.max())
            want[i, h] = (p / p.sum()) @ vc[g, lo : pos + 1].astype(np.float64)
    assert np.abs(got - want).max() < 1e-5
    # Without the cap the same scores give another result: the cap is applied.
    from cortiq_engine.kernels.reference import NumpyKernels

    plain = NumpyKernels().attend(q, kc, vc, start, window, scale)
    assert np.abs(plain - want).max() > 1e-2
