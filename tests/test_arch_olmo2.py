"""OLMo 2 on tiny random checkpoints (fast, for CI): the engine against transformers'
Olmo2ForCausalLM (post-sublayer norms only, q/k RMS norms over the whole projection
width), the full-width q/k norm shown to differ from a per-head one, and a tiny olmo2
GGUF written the way llama.cpp writes one (F32 and Q8_0) imported to the source weights.
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

    (qa, q), (ka, k), (va, v), (oa, o) = (
        w(nh * hd, h, "q"),
        w(nkv * hd, h, "k"),
        w(nkv * hd, h, "v"),
        w(h, nh * hd, "o"),
    )
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
        return Attention(
            ks,
            AttentionWeights(q, k, v, o, q_norm=qnorm, k_norm=kn),
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=hd,
            v_head_dim=hd,
            rope=None,
            norm_eps=eps,
            qk_norm_full=True,
        )

    full = attention()
    got = full(x, full.make_cache(8), Step(np.arange(n)))
    want, per_head = by_hand(nh * hd, nkv * hd), by_hand(hd, hd)
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.abs(per_head - want).max() > 1e-2 * np.abs(want).max()
    with pytest.raises(CortiqError, match="q_norm has 8 values, the attention geometry needs 32"):
        attention(qn[:hd])


# ------------------------------------------------------------------ a tiny olmo2 GGUF
_GGUF_NAMES = {
    "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_olmo2_gguf(model, path, weight_type: str = "F32", sliding_window: int | None = None):
    """What llama.cpp's converter writes for Olmo2ForCausalLM: q/k rows as HF has them
    (no permutation), full-width q/k norms, a byte-level BPE vocabulary."""
    import gguf
    from tokenizers import pre_tokenizers

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "olmo2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    toks = (
        sorted(pre_tokenizers.ByteLevel.alphabet())
        + ["<|s|>", "<|e|>"]
        + [f"<|x{i}|>" for i in range(cfg.vocab_size - 258)]
    )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * 256 + [3] * (len(toks) - 256))
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    for name, t in model.state_dict().items():
        x = t.detach().numpy().astype(np.float32)
        if name in _TOP:
            gname = _TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
        if weight_type != "F32" and x.ndim == 2:
            qt = getattr(gguf.GGMLQuantizationType, weight_type)
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_tiny_olmo2_gguf_matches_transformers(tiny, tmp_path, weight_type):
    """The GGUF imports to the source weights (F32: exactly; Q8_0: as gguf-py
    dequantizes them) and the engine's logits match transformers on the imported folder
    (F32: the source model itself)."""
    import gguf
    import torch
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM

    from cortiq_engine.convert import import_gguf

    src, alphabet = tiny[0], sorted(pre_tokenizers.ByteLevel.alphabet())
    write_olmo2_gguf(src, tmp_path / "o.gguf", weight_type)
    report = import_gguf(tmp_path / "o.gguf", tmp_path / "hf")
    assert report.model_type == "olmo2" and not report.tied_embeddings
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours_sd = ours.state_dict()
    qt = getattr(gguf.GGMLQuantizationType, weight_type)
    for name, t in src.state_dict().items():
        want = (
            t.numpy()
            if t.ndim == 1 or weight_type == "F32"
            else gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qt), qt)
        )
        assert np.array_equal(ours_sd[name].numpy(), want), name
    convert_checkpoint(tmp_path / "hf", tmp_path / "o.cmf", quant="f32")
    ids = arch_tiny.sample_ids(N_IDS, seed=4, vocab=300)
    with Engine.load(tmp_path / "o.cmf") as eng:
        assert eng.tokenizer.encode("hi") == [alphabet.index(c) for c in "hi"]  # the byte-level vocabulary
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, arch_tiny.torch_logits(src if weight_type == "F32" else ours, ids)) < 1e-4
    # `cortiq convert FILE.gguf` streams the same model without the folder.
    convert_checkpoint(tmp_path / "o.gguf", tmp_path / "direct.cmf", quant="f32")
    with Engine.load(tmp_path / "direct.cmf") as eng:
        assert np.array_equal(eng.logits(ids), got)


def test_olmo3_gguf_is_refused(tiny, tmp_path):
    """llama.cpp files OLMo 3 (sliding-window layers) under olmo2: refused, nothing written."""
    from cortiq_engine.convert import import_gguf

    write_olmo2_gguf(tiny[0], tmp_path / "o.gguf", sliding_window=4096)
    with pytest.raises(CortiqError, match="sliding_window"):
        import_gguf(tmp_path / "o.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
