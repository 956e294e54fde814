"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini) on tiny random checkpoints against
transformers' Phi3ForCausalLM: the fused qkv_proj / gate_up_proj split at conversion,
a sliding window, LongRoPE whose prompt plus generation crosses
original_max_position_embeddings, and partial rotary with tied embeddings (the
Phi-4-mini shape). Also the rotary tables against Phi3RotaryEmbedding and the
refusals of what the engine does not compute.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cortiq_engine import Engine, SamplingConfig
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.layers import RoPE
from cortiq_engine.models import FAMILIES, parse_config
from formats.arch import LAYER_FULL, LAYER_SLIDING
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.sanitize import SanitizeRules, split_fused_rows
from tests import arch_tiny
from tests.tiny import build_tiny

ORIG = 32  # original_max_position_embeddings: the 24-token prompt is within it, prompt + 16 is past it
PROMPT, NEW = 24, 16


def _factors(n: int, seed: int, lo: float, hi: float) -> list[float]:
    return [float(x) for x in np.random.default_rng(seed).uniform(lo, hi, n)]


def _longrope(rotary_dim: int) -> dict:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": _factors(rotary_dim // 2, 1, 1.0, 2.0),
        "long_factor": _factors(rotary_dim // 2, 2, 2.0, 6.0),
    }


COMMON = dict(pad_token_id=None, max_position_embeddings=256)
CONFIGS = {
    "plain": dict(COMMON),
    "sliding": dict(COMMON, sliding_window=7),
    "longrope": dict(COMMON, original_max_position_embeddings=ORIG, rope_parameters=_longrope(16)),
    # Phi-4-mini's shape: 3/4 of each head rotated, tied embeddings, LongRoPE.
    "partial_tied": dict(
        COMMON,
        tie_word_embeddings=True,
        original_max_position_embeddings=ORIG,
        rope_parameters={**_longrope(12), "partial_rotary_factor": 0.75},
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (transformers model, HF folder, f32 CMF)."""
    root = tmp_path_factory.mktemp("phi3")
    out = {}
    for case, cfg in CONFIGS.items():
        model = build_tiny("phi3", seed=3, **cfg)
        src = arch_tiny.save(model, root / case)
        cmf = root / f"{case}.cmf"
        convert_checkpoint(src, cmf, quant="f32")
        out[case] = (model, src, cmf)
    return out


def test_arch_parsed_from_config(tiny):
    arch = {c: parse_config(json.loads((tiny[c][1] / "config.json").read_text())) for c in CONFIGS}
    assert all(a.arch == "phi3" and a.norm_eps == 1e-6 and a.hidden_act == "silu" for a in arch.values())
    assert arch["plain"].layer_types == [LAYER_FULL] * 2 and arch["plain"].rope_scaling is None
    assert arch["sliding"].layer_types == [LAYER_SLIDING] * 2 and arch["sliding"].sliding_window == 7
    rs = arch["longrope"].rope_scaling
    assert (
        rs["rope_type"] == "longrope" and rs["original_max_position_embeddings"] == ORIG and len(rs["long_factor"]) == 8
    )
    p = arch["partial_tied"]
    assert p.rotary_dim == 12 and p.head_dim == 16 and p.tie_word_embeddings


def test_release_style_config_parses_like_transformers_saves_it(tiny):
    """A hub config.json (rope_scaling with Phi-3's old "su" type, the pretraining length
    and partial_rotary_factor at the top level) gives the same ArchConfig as the one
    transformers 5 writes (everything in rope_parameters)."""
    saved = json.loads((tiny["partial_tied"][1] / "config.json").read_text())
    rp = saved["rope_parameters"]
    hub = {k: v for k, v in saved.items() if k != "rope_parameters"}
    hub.update(
        rope_theta=rp["rope_theta"],
        partial_rotary_factor=0.75,
        rope_scaling={"type": "su", "short_factor": rp["short_factor"], "long_factor": rp["long_factor"]},
    )
    assert parse_config(hub) == parse_config(saved)


def test_fused_tensors_split_by_rows(tiny):
    """q/k/v are qkv_proj's rows in that order; gate is gate_up_proj's first half."""
    model, _, cmf = tiny["plain"]
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    q, kv, inter = 4 * 16, 2 * 16, 128
    with CmfFile(cmf) as f:
        assert not any("qkv_proj" in n or "gate_up_proj" in n for n in f.names())
        for i in range(2):
            p = f"model.layers.{i}."
            qkv, gu = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
            parts = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q : q + kv], "self_attn.v_proj": qkv[q + kv :],
                     "mlp.gate_proj": gu[:inter], "mlp.up_proj": gu[inter:]}  # fmt: skip
            for name, want in parts.items():
                np.testing.assert_array_equal(f.tensor_f32(f"{p}{name}.weight"), want)


@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny, case, kernels):
    """One full forward each: the prompt (LongRoPE's short factors) and prompt +
    generation length (past the original length: the long factors)."""
    model, _, cmf = tiny[case]
    with Engine.load(cmf, kernels=kernels) as eng:
        for n in (PROMPT, PROMPT + NEW):
            ids = arch_tiny.sample_ids(n, seed=5)
            err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids))
            assert err < 1e-4, (case, n, err)


def _long_everywhere(model):
    """The same transformers model with LongRoPE's short factors set to its long ones: it
    rotates every position with the long factors, whatever the sequence's length."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters["short_factor"] = list(cfg.rope_parameters["long_factor"])
    twin = type(model)(cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("case", list(CONFIGS))
def test_greedy_matches_transformers_generate(tiny, case):
    """16 greedy tokens against transformers' generate with its KV cache. The engine picks
    LongRoPE's factors once per sequence from its context (here prompt + 16 > the
    original length: the long factors for every token, as llama.cpp picks by n_ctx);
    its oracle is the same model rotating every position with the long factors. Within
    the original length (a context of ORIG) both use the short factors throughout."""
    import torch

    model, _, cmf = tiny[case]
    ids = arch_tiny.sample_ids(PROMPT, seed=7)
    longrope = "rope_parameters" in CONFIGS[case]
    for ctx, new, oracle in (
        (PROMPT + NEW, NEW, _long_everywhere(model) if longrope else model),
        (ORIG, ORIG - PROMPT, model),
    ):
        with torch.no_grad():
            ref = oracle.generate(
                torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True
            )[0, PROMPT:].tolist()
        with Engine.load(cmf, ctx=ctx) as eng:
            got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=new, ignore_eos=True)
        assert got.token_ids == ref, (case, ctx)


@pytest.mark.parametrize("case", ["longrope", "partial_tied"])
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_a_sequence_rotates_alike_however_its_calls_split(tiny, case, kernels):
    """Prefill then one token at a time gives the logits of one whole forward over the
    same context, and both those of transformers' full forward of the whole sequence
    (past the original length: the long factors at every position)."""
    from cortiq_engine import forward

    model, _, cmf = tiny[case]
    ids = arch_tiny.sample_ids(PROMPT + NEW, seed=7)
    with Engine.load(cmf, kernels=kernels) as eng:
        m = eng.model
        st = m.new_state(len(ids))
        whole = m.lm_head(m.final_norm(forward(st, ids)))
        st = m.new_state(len(ids))
        rows = [m.lm_head(m.final_norm(forward(st, ids[:PROMPT])))]
        rows += [m.lm_head(m.final_norm(forward(st, [t]))) for t in ids[PROMPT:]]
    split = np.concatenate(rows)
    assert arch_tiny.rel_err(split, whole) < 1e-5
    assert arch_tiny.rel_err(whole, arch_tiny.torch_logits(model, ids)) < 1e-4


@pytest.mark.parametrize("case", ["plain", "partial_tied"])
def test_q8_conversion_stays_close(tiny, case, tmp_path):
    model, src, _ = tiny[case]
    out = tmp_path / "q8.cmf"
    rep = convert_checkpoint(src, out, quant="q8")
    assert rep.by_dtype["q8"].tensors > 0
    ids = arch_tiny.sample_ids(PROMPT + NEW, seed=5)
    with Engine.load(out) as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 0.05


@pytest.mark.parametrize("case", ["longrope", "partial_tied"])
def test_rope_tables_match_phi3_rotary_embedding(tiny, case):
    """The engine's tables against Phi3RotaryEmbedding for calls on both sides of the
    original length and across it: short factors up to it, long ones for a whole call
    that reaches past it, cos/sin scaled by the attention factor."""
    import torch
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    model, src, _ = tiny[case]
    arch = parse_config(json.loads((src / "config.json").read_text()))
    rope = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)
    hf = Phi3RotaryEmbedding(model.config)
    assert rope.attention_factor == pytest.approx(hf.attention_scaling) and rope.attention_factor > 1.1
    half = arch.rotary_dim // 2
    seen = set()
    for lo, hi in ((0, PROMPT), (0, ORIG), (ORIG - 1, ORIG), (ORIG, ORIG + 1), (ORIG - 3, ORIG + 3), (0, PROMPT + NEW)):
        cos, sin = hf(torch.zeros(1), torch.arange(lo, hi)[None])
        got_cos, got_sin = rope.tables(np.arange(lo, hi))
        np.testing.assert_allclose(got_cos, cos[0, :, :half].numpy(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(got_sin, sin[0, :, :half].numpy(), rtol=0, atol=2e-6)
        seen.add(hi > ORIG)
    assert seen == {False, True}
    assert not np.allclose(
        rope.tables(np.arange(ORIG - 1, ORIG))[0], rope.tables(np.arange(ORIG - 2, ORIG + 1))[0][1:2]
    )


def _cfg(**over):
    base = dict(model_type="phi3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                intermediate_size=32, vocab_size=16)  # fmt: skip
    return {**base, **over}


def test_unsupported_config_values_are_refused():
    with pytest.raises(CortiqError, match="rope_scaling type 'dynamic' is not supported"):
        parse_config(_cfg(rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(CortiqError, match=r"short_factor has 3 entries, the rotary width 16 needs 8"):
        parse_config(_cfg(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}))
    with pytest.raises(CortiqError, match="long_factor is 'None'"):
        parse_config(_cfg(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}))
    with pytest.raises(CortiqError, match="sliding_window"):
        parse_config(_cfg(sliding_window=0))
    with pytest.raises(CortiqError, match="partial_rotary_factor"):
        parse_config(_cfg(partial_rotary_factor=1.5))


def test_fused_rows_that_do_not_add_up_are_refused():
    rules = FAMILIES.for_model_type("phi3").rules_for(_cfg())
    parts = split_fused_rows("model.layers.0.self_attn.qkv_proj.weight", "src", (128, 64), rules)
    assert {n: (s.r0, s.r1) for n, s in parts.items()} == {
        "model.layers.0.self_attn.q_proj.weight": (0, 64), "model.layers.0.self_attn.k_proj.weight": (64, 96),
        "model.layers.0.self_attn.v_proj.weight": (96, 128),
    }  # fmt: skip
    with pytest.raises(CortiqError, match=r"tensor src has shape \[120, 64\]: expected \[64 \+ 32 \+ 32, columns\]"):
        split_fused_rows("model.layers.0.self_attn.qkv_proj.weight", "src", (120, 64), rules)
    assert split_fused_rows("model.layers.0.mlp.experts.gate_up_proj", "src", (4, 64, 64), rules) == {}
    assert split_fused_rows("x.mlp.gate_up_proj.weight", "x", (4, 2), SanitizeRules()) == {}


# ------------------------------------------------------------------ a tiny phi3 GGUF
_GGUF_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_phi3_gguf(model, path, weight_type: str = "F32"):
    """The GGUF llama.cpp's converter (``Phi3MiniModel``) writes: the fused projections
    as they are (no row permutation), rope.dimension_count = int(factor * hidden) // heads,
    sliding_window 0 when there is none, the LongRoPE factors as tensors; the byte-level
    vocabulary of ``tests.tiny`` (Phi-4's tokenizer is byte-level BPE)."""
    import gguf
    from tokenizers import pre_tokenizers

    cfg = model.config
    rp = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    w.add_token_types([1] * 256)
    if rp.get("long_factor"):
        w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], np.float32))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = t.detach().numpy().astype(np.float32)
        gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}.get(name)  # fmt: skip
        if gname is None:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_PARTS[module]}.{kind}"
        if weight_type != "F32" and x.ndim == 2:
            qt = gguf.GGMLQuantizationType[weight_type]
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_CASES = {
    "sliding": dict(COMMON, sliding_window=7),
    "partial_tied": dict(COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                         "partial_rotary_factor": 0.75}),
}  # fmt: skip


@pytest.mark.parametrize("case,weight_type,quant", [
    ("sliding", "F32", "f32"), ("partial_tied", "F32", "f32"), ("sliding", "Q8_0", "f32"), ("partial_tied", "Q8_0", "q8"),
])  # fmt: skip
def test_gguf_matches_transformers(tmp_path, case, weight_type, quant):
    """A phi3 GGUF as llama.cpp writes it converts straight to the source model: the
    fused attn_qkv / ffn_up split like the HF tensors, the partial rotary width and the
    window read back from the metadata. A Q8_0 file into q8 copies the blocks of the
    tensors it keeps whole and re-encodes the row slices of the fused ones."""
    src = build_tiny("phi3", seed=4, **GGUF_CASES[case])
    path = write_phi3_gguf(src, tmp_path / "p.gguf", weight_type)
    report = convert_checkpoint(path, tmp_path / "p.cmf", quant=quant)
    if quant == "q8":
        assert "model.layers.0.self_attn.o_proj.weight" in report.block_copied
        assert not any(n.endswith(("q_proj.weight", "gate_proj.weight")) for n in report.block_copied)
    ids = arch_tiny.sample_ids(PROMPT + NEW, seed=5)
    with Engine.load(tmp_path / "p.cmf") as eng:
        got_arch = eng.model.arch
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(src, ids))
    want = parse_config(json.loads(src.config.to_json_string()))
    assert (got_arch.rotary_dim, got_arch.sliding_window, got_arch.tie_word_embeddings) == (
        want.rotary_dim,
        want.sliding_window,
        want.tie_word_embeddings,
    )
    assert err < (1e-4 if weight_type == "F32" else 0.05), err


def test_longrope_gguf_matches_transformers(tmp_path):
    """llama.cpp's rope_factors_long / rope_factors_short tensors become config.json's
    LongRoPE factors: the GGUF's conversion has the logits of the source model, on both
    sides of the original length."""
    src = build_tiny("phi3", seed=4, **CONFIGS["longrope"])
    path = write_phi3_gguf(src, tmp_path / "p.gguf")
    convert_checkpoint(path, tmp_path / "p.cmf", quant="f32")
    with Engine.load(tmp_path / "p.cmf") as eng:
        for n in (PROMPT, PROMPT + NEW):
            ids = arch_tiny.sample_ids(n, seed=5)
            assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(src, ids)) < 1e-4, n
