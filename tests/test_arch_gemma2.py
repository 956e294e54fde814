"""Gemma 2 on tiny random checkpoints (fast, for CI): the engine against transformers'
Gemma2ForCausalLM with attention and final soft-caps small enough to bite (each shown
to change the logits), mixed sliding / global layers with a window of 6 (shown to
matter), the f32 attention soft-cap kernel against float64 math, and a tiny gemma2
GGUF written the way llama.cpp writes one (F32 and Q8_0) against transformers' own
GGUF loader.
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


# ------------------------------------------------------------------ a tiny gemma2 GGUF
_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def spm_vocab(n: int) -> tuple[list[str], list[int]]:
    """A Gemma-shaped SentencePiece vocabulary of ``n``: specials, byte tokens, pieces."""
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3] * len(toks)
    toks += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = list(
        dict.fromkeys(["\u2581", "\u2581t", "he", "\u2581the", "an", "\u2581an", "nd", "\u2581and", *"thenadob"])
    )
    pieces = pieces[: n - len(toks)]
    pieces += [f"p{i}" for i in range(n - len(toks) - len(pieces))]
    return toks + pieces, types + [1] * (n - len(toks))


def write_gemma2_gguf(model, path: Path, weight_type: str = "F32") -> Path:
    """What llama.cpp's converter writes for Gemma2ForCausalLM: no rope base (10000),
    the window and both caps, norms as 1 + w, no output.weight (tied)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    toks, types = spm_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores([-float(i) for i in range(len(toks))])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        x = t.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
        if gname.endswith("norm.weight"):
            x = x + 1
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


# llama.cpp fixes what a gemma2 GGUF does not store: layers alternate from a sliding
# one, the query scale is head_dim**-0.5, RoPE's base is 10000.
GGUF_TINY = dict(layer_types=None, query_pre_attn_scalar=TINY["head_dim"])


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_tiny_gemma2_gguf_matches_transformers(tmp_path: Path, weight_type: str):
    """The GGUF imports to the source weights (F32: exactly) and the engine's logits
    match transformers' own GGUF loader (given the caps, which it does not read)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cortiq_engine.convert import import_gguf

    src = build(**GGUF_TINY)
    write_gemma2_gguf(src, tmp_path / "g.gguf", weight_type)
    report = import_gguf(tmp_path / "g.gguf", tmp_path / "hf")
    assert report.tied_embeddings and report.model_type == "gemma2"
    arch = parse_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert arch.layer_types == [LAYER_SLIDING, LAYER_FULL] * 2 and arch.sliding_window == 6
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping, arch.query_pre_attn_scalar) == (5.0, 3.0, 16)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    if weight_type == "F32":
        ours_sd = ours.state_dict()
        for name, t in src.state_dict().items():
            assert torch.allclose(ours_sd[name], t, rtol=0, atol=1e-6), name
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        gguf_file="g.gguf",
        dtype=torch.float32,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ).eval()
    convert_checkpoint(tmp_path / "hf", tmp_path / "g.cmf", quant="f32")
    hf_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="g.gguf")
    with Engine.load(tmp_path / "g.cmf") as eng:
        for text in ["the and an thane", "<start_of_turn>user\nhi<end_of_turn>"]:
            assert eng.tokenizer.encode(text) == hf_tok(text)["input_ids"], text
        ids = arch_tiny.sample_ids(N_IDS, seed=4, vocab=300)
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, arch_tiny.torch_logits(ref, ids)) < 1e-4
    # `cortiq convert FILE.gguf` streams the same model without the folder.
    convert_checkpoint(tmp_path / "g.gguf", tmp_path / "direct.cmf", quant="f32")
    with Engine.load(tmp_path / "direct.cmf") as eng:
        assert np.array_equal(eng.logits(ids), got)
    assert arch_tiny.rel_err(got, arch_tiny.torch_logits(ours, ids)) < 1e-4
