"""GPT-OSS on tiny random checkpoints (fast, for CI): the engine against transformers'
GptOssForCausalLM (sinks, alternating sliding window, biased attention, YaRN, a biased
router, biased experts with the clamped SwiGLU), the router and the expert against
transformers' own modules, and an MXFP4 checkpoint in the release's naming (quantized
here, decoded by transformers' ``convert_moe_packed_tensors`` for the oracle)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cortiq_engine import Engine, SamplingConfig
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.models import parse_config
from formats import mxfp4
from formats.arch import LAYER_FULL, LAYER_SLIDING, MoeConfig
from formats.checkpoint import open_checkpoint
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.sanitize import InterleavedExperts, SanitizeRules
from tests import arch_tiny
from tests.tiny import build_tiny, write_byte_tokenizer

RULES = SanitizeRules(renames=((r"\.mlp\.router\.", ".mlp.gate."),), interleaved_experts=True)


def _randomize(model, seed: int = 0):
    """What the init leaves near zero and the test must see: sinks, the router (and its
    bias), the experts' biases; expert weights large enough that the clamp bites."""
    import torch

    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
            elif name.endswith("mlp.router.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("mlp.router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.mul_(8.0)
    return model


def build(seed: int = 0):
    return _randomize(build_tiny("gpt_oss", seed=seed, **arch_tiny.CONFIGS["gpt_oss"]), seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    model = build()
    src = arch_tiny.save(model, root / "hf")
    cmf = root / "g.cmf"
    convert_checkpoint(src, cmf, quant="f32")
    return model, src, cmf


def test_arch_parsed_from_config(tiny):
    arch = parse_config(json.loads((tiny[1] / "config.json").read_text()))
    assert arch.arch == "gpt_oss" and arch.attention_sinks and arch.attention_bias
    assert arch.layer_types == [LAYER_SLIDING, LAYER_FULL, LAYER_SLIDING, LAYER_FULL] and arch.sliding_window == 6
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["truncate"] is False
    m = arch.moe
    assert (m.num_experts, m.top_k, m.expert_intermediate_size) == (4, 2, 96)
    assert m.router_bias and m.expert_bias and m.norm_topk_prob and m.moe_layers == [0, 1, 2, 3]
    assert (m.swiglu_limit, m.swiglu_alpha) == (1.0, pytest.approx(1.702))


def test_converted_names_are_per_expert(tiny):
    with CmfFile(tiny[2]) as f:
        names = set(f.names())
        assert f.info("model.layers.0.mlp.experts.3.gate_proj.weight").shape == (96, 64)
        assert f.info("model.layers.0.mlp.experts.3.down_proj.weight").shape == (64, 96)
    for n in (
        "mlp.gate.weight",
        "mlp.gate.bias",
        "mlp.experts.1.up_proj.bias",
        "mlp.experts.1.down_proj.bias",
        "self_attn.sinks",
    ):
        assert f"model.layers.2.{n}" in names
    assert not any("router" in n or "gate_up" in n for n in names)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny, kernels):
    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(24)  # 24 > the window of 6: the sliding layers forget
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


def test_sinks_window_and_router_bias_matter(tiny, tmp_path):
    """Each of them moves the logits well beyond the tolerance (so the test above sees them)."""
    import torch

    model, _, _ = tiny
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    for change in ("sinks", "router", "window"):
        other = build()
        with torch.no_grad():
            for name, p in other.named_parameters():
                if change == "sinks" and name.endswith("self_attn.sinks"):
                    p.zero_()
                if change == "router" and name.endswith("mlp.router.bias"):
                    p.zero_()
        if change == "window":
            other.config.sliding_window = 24
            for layer in other.model.layers:
                if layer.self_attn.sliding_window:
                    layer.self_attn.sliding_window = 24
        assert arch_tiny.rel_err(arch_tiny.torch_logits(other, ids), ref) > 1e-2, change


def test_greedy_tokens_match_transformers(tiny):
    import torch

    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(8, seed=3)
    with Engine.load(cmf) as eng:
        got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=16, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 8:].tolist()
    assert got == ref


def test_q8_conversion_stays_close(tiny, tmp_path):
    model, src, _ = tiny
    out = tmp_path / "q8.cmf"
    rep = convert_checkpoint(src, out, quant="q8")
    assert rep.by_dtype["q8"].tensors > 0
    ids = arch_tiny.sample_ids(24)
    with Engine.load(out) as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 0.05


def test_bf16_checkpoint_converts(tmp_path):
    """A bf16 checkpoint (how transformers saves the dequantized release): the strided
    gate/up views widen the bf16 rows they read."""
    import torch

    model = build(seed=2).to(torch.bfloat16)
    src = arch_tiny.save(model, tmp_path / "hf")
    convert_checkpoint(src, tmp_path / "b.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24, seed=2)
    with Engine.load(tmp_path / "b.cmf") as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model.float(), ids)) < 1e-4


# ------------------------------------------------------------------ router and expert against transformers
def test_router_equals_softmax_topk_renormalized():
    """transformers' top-k of the logits then softmax over the k == the engine's softmax,
    top-k, renormalize, with the router bias added to the logits."""
    import torch
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from cortiq_engine.moe import route

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=16, num_local_experts=8, num_experts_per_tok=3)
    router = GptOssTopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.bias.copy_(torch.randn(8, generator=g))
    x = torch.randn(64, 16, generator=g)
    _, ref_w, ref_idx = router(x)
    logits = x.numpy() @ router.weight.detach().numpy().T + router.bias.detach().numpy()
    idx, w = route(
        logits.astype(np.float32), MoeConfig(num_experts=8, top_k=3, expert_intermediate_size=4, norm_topk_prob=True)
    )
    for r in range(64):
        ref = dict(zip(ref_idx[r].tolist(), ref_w[r].detach().tolist()))
        got = dict(zip(idx[r].tolist(), w[r].tolist()))
        assert set(ref) == set(got)
        for e in ref:
            assert got[e] == pytest.approx(ref[e], rel=1e-5)


def test_biased_expert_matches_transformers_clamped_swiglu():
    import torch
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from cortiq_engine.kernels import NumpyKernels
    from cortiq_engine.moe import BiasedExpert
    from cortiq_engine.weights import Weight

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=32, intermediate_size=24, num_local_experts=1, swiglu_limit=2.0)
    ex = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(10, 32, generator=g)
    with torch.no_grad():
        ref = ex(x, torch.zeros(10, 1, dtype=torch.long), torch.ones(10, 1)).numpy()
        gu = (x @ ex.gate_up_proj[0]).numpy()
    assert (gu[:, ::2] > 2.0).any() and (np.abs(gu[:, 1::2]) > 2.0).any()  # the clamp bites
    gup, gub = ex.gate_up_proj[0].detach().numpy(), ex.gate_up_proj_bias[0].detach().numpy()

    def w(name, a):
        a = np.ascontiguousarray(a, dtype=np.float32)
        return Weight(name, "f32", a.shape[0], a.shape[1], {"data": a})

    expert = BiasedExpert(
        NumpyKernels(),
        w("g", gup[:, ::2].T),
        w("u", gup[:, 1::2].T),
        w("d", ex.down_proj[0].detach().numpy().T),
        gub[::2].copy(),
        gub[1::2].copy(),
        ex.down_proj_bias[0].detach().numpy().copy(),
        limit=2.0,
        alpha=1.702,
    )
    np.testing.assert_allclose(expert(x.numpy()), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ MXFP4
def _to_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., K] -> (blocks [..., K/32, 16], scales [..., K/32]): a shared power of two per
    32 values (the smallest that fits the largest in E2M1's 6), each value the nearest E2M1."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32).astype(np.float64)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).clip(-127, 127).astype(np.int32)
    scaled = g / np.exp2(e)[..., None]
    codes = np.abs(scaled[..., None] - mxfp4.FP4_VALUES.astype(np.float64)).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


def _write_mxfp4(model, folder):
    """The tiny model as the release stores it: experts as MXFP4 blocks/scales [E, out, in/32, 16],
    biases in bf16; the transformers model then holds the dequantized values (the oracle)."""
    import torch
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = _to_mxfp4(p.numpy().transpose(0, 2, 1))  # [E, in, out] -> rows [out, in]
                tb, ts = torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(scales))
                out[name + "_blocks"], out[name + "_scales"] = tb, ts
                p.copy_(convert_moe_packed_tensors(tb, ts, dtype=torch.float32))
            elif name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                p.copy_(p.to(torch.bfloat16).float())
                out[name] = p.to(torch.bfloat16).contiguous()
            else:
                out[name] = p.contiguous().clone()
    save_file(out, str(folder / "model.safetensors"))
    cfg = json.loads(json.dumps(model.config.to_dict()))
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens", "lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def mxfp4_tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = build(seed=5)
    src = _write_mxfp4(model, root / "hf")
    return model, src


def test_mxfp4_checkpoint_converts_to_transformers_logits(mxfp4_tiny, tmp_path):
    model, src = mxfp4_tiny
    cmf = tmp_path / "m.cmf"
    convert_checkpoint(src, cmf, quant="f32")
    ids = arch_tiny.sample_ids(24, seed=1)
    with Engine.load(cmf) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, arch_tiny.torch_logits(model, ids)) < 1e-4
    with CmfFile(cmf) as f:  # the decoded experts are exactly transformers' dequantized ones
        gate = f.tensor_f32("model.layers.1.mlp.experts.2.gate_proj.weight")
    ref = model.model.layers[1].mlp.experts.gate_up_proj[2].detach().numpy()[:, ::2].T
    np.testing.assert_array_equal(gate, ref)


def test_mxfp4_views_stream_by_rows(mxfp4_tiny):
    """The views decode a row range at a time: small slices concatenate to the whole."""
    model, src = mxfp4_tiny
    ck = InterleavedExperts(open_checkpoint(src), RULES)
    try:
        for name, ref in (
            (
                "model.layers.0.mlp.experts.1.up_proj.weight",
                model.model.layers[0].mlp.experts.gate_up_proj[1][:, 1::2].T,
            ),
            ("model.layers.3.mlp.experts.0.down_proj.weight", model.model.layers[3].mlp.experts.down_proj[0].T),
            (
                "model.layers.2.mlp.experts.3.gate_proj.bias",
                model.model.layers[2].mlp.experts.gate_up_proj_bias[3][::2],
            ),
        ):
            ref = ref.detach().numpy()
            parts = list(ck.iter_f32_rows(name, max_elems=64 * 5))
            assert ck.shape(name) == ref.shape and ck.source_dtype(name) == "BF16"
            np.testing.assert_array_equal(np.concatenate(parts).reshape(ref.shape), ref)
            np.testing.assert_array_equal(ck.tensor(name), ref)
            flat = np.linspace(0, ref.size - 1, num=min(64, ref.size)).astype(np.int64)
            np.testing.assert_array_equal(ck.sample_f32(name), ref.reshape(-1)[flat])
            if ref.ndim == 2:  # slices of at most max_elems values: never a whole expert, let alone a stack
                assert len(parts) > 1 and all(x.size <= 64 * 5 for x in parts)
    finally:
        ck.close()


def test_mxfp4_decode_matches_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (2, 3, 4), dtype=np.uint8)
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(mxfp4.decode(blocks, scales), ref.transpose(1, 2).numpy())


@pytest.mark.parametrize(
    "edit,match",
    [
        ("drop_scales", "has no scales beside it"),
        ("bad_scales_shape", "scales .* have shape"),
        ("nan_scale", r"scale code 255 \(NaN\)"),
        ("float_blocks", "must be U8"),
    ],
)
def test_bad_mxfp4_input_is_refused(mxfp4_tiny, tmp_path, edit, match):
    import shutil

    from safetensors.torch import load_file as tload, save_file as tsave

    _, src = mxfp4_tiny
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)

    t = tload(str(bad / "model.safetensors"))
    key = "model.layers.1.mlp.experts.down_proj"
    if edit == "drop_scales":
        del t[key + "_scales"]
    elif edit == "bad_scales_shape":
        t[key + "_scales"] = t[key + "_scales"][:, :-1].contiguous()
    elif edit == "nan_scale":
        s = t[key + "_scales"].clone()
        s[0, 0, 0] = 255
        t[key + "_scales"] = s
    elif edit == "float_blocks":
        t[key + "_blocks"] = t[key + "_blocks"].float()
    tsave(t, str(bad / "model.safetensors"))
    with pytest.raises(CortiqError, match=match) as e:
        convert_checkpoint(bad, tmp_path / "m.cmf", quant="f32")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "m.cmf").exists()


def test_release_style_config_is_parsed():
    """The release's config.json keys (transformers 4.55: rope_scaling beside rope_theta,
    experts_per_token, no swiglu_alpha, an mxfp4 quantization_config)."""
    cfg = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "sliding_window": 128,
        "num_local_experts": 32,
        "experts_per_token": 4,
        "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "attention_bias": True,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []},
    }
    arch = parse_config(cfg)
    assert (arch.rope_theta, arch.rope_scaling["factor"], arch.sliding_window, arch.norm_eps) == (
        150000.0,
        32.0,
        128,
        1e-5,
    )
    assert (arch.moe.top_k, arch.moe.num_experts, arch.moe.swiglu_limit, arch.moe.swiglu_alpha) == (4, 32, 7.0, 1.702)


@pytest.mark.parametrize(
    "change,match",
    [
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]},
            "layer_types",
        ),
        ({"swiglu_limit": 0}, "swiglu_limit is 0.0"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8' is not supported"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 10000.0}}, "rope scaling type 'su'"),
    ],
)
def test_unsupported_or_bad_config_is_refused(tiny, change, match):
    cfg = {**json.loads((tiny[1] / "config.json").read_text()), **change}
    with pytest.raises(CortiqError, match=match):
        parse_config(cfg)


def test_yarn_tables_match_transformers():
    """The release's YaRN (factor 32 over 4096, truncate false, theta 150000): the engine's
    frequencies against GptOssRotaryEmbedding's to one float32 ulp (numpy's and torch's
    float32 pow round a few exponents differently), its attention factor, and the cos/sin
    tables up to the original context, where one ulp of a frequency moves an angle < 2e-4."""
    import torch
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from cortiq_engine.models import blocks

    cfg = AutoConfig.for_model("gpt_oss", num_hidden_layers=2, max_position_embeddings=131072)
    rope = blocks.rope(parse_config(cfg.to_dict()))
    emb = GptOssRotaryEmbedding(cfg)
    np.testing.assert_allclose(rope.inv_freq, emb.inv_freq.numpy(), rtol=2.5e-7, atol=0)
    assert rope.attention_factor == pytest.approx(emb.attention_scaling, rel=1e-7)
    assert rope.attention_factor == pytest.approx(0.1 * np.log(32) + 1)
    pos = np.array([0, 1, 127, 2048, 4095], np.int64)
    cos, sin = rope.tables(pos)
    ref_cos, ref_sin = emb(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos)[None])
    np.testing.assert_allclose(cos, ref_cos[0].numpy(), atol=3e-4)
    np.testing.assert_allclose(sin, ref_sin[0].numpy(), atol=3e-4)


# ------------------------------------------------------------------ GGUF
def write_gpt_oss_gguf(model, path, expert_type: str = "F32"):
    """The GGUF llama.cpp's converter (``GptOssModel``) writes: the experts stacked per
    projection [experts, out, in] with gate and up de-interleaved (MXFP4 blocks when
    ``expert_type`` is MXFP4, as it repacks the release's), their biases split alike, the
    router as ffn_gate_inp, sinks as attn_sinks.weight, the second norm as
    post_attention_norm, YaRN's factor and original length; a byte-level vocabulary."""
    import gguf
    from tokenizers import pre_tokenizers

    cfg = model.config
    rp = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rp["factor"])
    w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    w.add_token_types([1] * 256)
    parts = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
    }  # fmt: skip
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip
    mx = gguf.GGMLQuantizationType.MXFP4
    for name, t in model.state_dict().items():
        x = t.detach().numpy().astype(np.float32)
        if name in globals_:
            w.add_tensor(globals_[name], x)
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "self_attn.sinks":
            w.add_tensor(blk + "attn_sinks.weight", x)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> gate / up [E, I, H]
            for part, half in (("ffn_gate_exps", x[..., ::2]), ("ffn_up_exps", x[..., 1::2])):
                _add_experts(w, blk + part + ".weight", np.ascontiguousarray(half.transpose(0, 2, 1)), expert_type, mx)
        elif rest == "mlp.experts.down_proj":  # [E, I, H] -> [E, H, I]
            _add_experts(w, blk + "ffn_down_exps.weight", np.ascontiguousarray(x.transpose(0, 2, 1)), expert_type, mx)
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(blk + "ffn_gate_exps.bias", np.ascontiguousarray(x[..., ::2]))
            w.add_tensor(blk + "ffn_up_exps.bias", np.ascontiguousarray(x[..., 1::2]))
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(blk + "ffn_down_exps.bias", x)
        else:
            module, kind = rest.rsplit(".", 1)
            w.add_tensor(f"{blk}{parts[module]}.{kind}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_experts(w, name, x, expert_type, mx):
    import gguf

    if expert_type == "MXFP4":
        w.add_tensor(name, gguf.quants.quantize(x, mx), raw_dtype=mx)
    else:
        w.add_tensor(name, x)


def _gguf_oracle(model):
    """The model with its expert weights as an MXFP4 GGUF holds them (gguf-py's decoding)."""
    import gguf
    import torch

    mx = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for p in (ex.gate_up_proj, ex.down_proj):
                x = p.detach().numpy().transpose(0, 2, 1)  # rows [out, in]: blocks run along the input
                q = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(x), mx), mx)
                p.copy_(torch.from_numpy(np.ascontiguousarray(q.reshape(x.shape).transpose(0, 2, 1))))
    return model


@pytest.mark.parametrize("expert_type", ["F32", "MXFP4"])
def test_gguf_matches_transformers(tmp_path, expert_type):
    """A gpt-oss GGUF as llama.cpp writes it converts to the source model: stacked experts
    split per expert, biases, sinks, router bias, window and YaRN read back."""
    src = build(seed=6)
    src.config.swiglu_limit = 7.0  # llama.cpp fixes the clamp at GPT-OSS's 7
    for layer in src.model.layers:
        layer.mlp.experts.limit = 7.0
    if expert_type == "MXFP4":
        src = _gguf_oracle(src)
    path = write_gpt_oss_gguf(src, tmp_path / "g.gguf", expert_type)
    convert_checkpoint(path, tmp_path / "g.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24, seed=7)
    with Engine.load(tmp_path / "g.cmf") as eng:
        arch = eng.model.arch
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(src, ids))
    want = parse_config(json.loads(src.config.to_json_string()))
    assert (arch.layer_types, arch.sliding_window, arch.rope_scaling) == (
        want.layer_types,
        want.sliding_window,
        want.rope_scaling,
    )
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.expert_intermediate_size) == (4, 2, 96)
    assert err < 1e-4, err


@pytest.mark.parametrize(
    "drop,match",
    [("expert_count", "gpt-oss.expert_count"), ("attention.sliding_window", "gpt-oss.attention.sliding_window")],
)
def test_gguf_without_expert_metadata_is_refused(tmp_path, drop, match):
    import gguf

    path = write_gpt_oss_gguf(build(seed=6), tmp_path / "g.gguf")
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "gpt-oss")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", f"gpt-oss.{drop}"):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(f.name, f.contents(), vt)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CortiqError, match=match) as e:
        convert_checkpoint(tmp_path / "bad.gguf", tmp_path / "g.cmf", quant="f32")
    assert "\n" not in str(e.value)
