"""DeepSeek-V3 (``deepseek_v3``): multi-head latent attention with a q LoRA (and without),
YaRN with mscale / mscale_all_dim, interleaved rotary pairs, dense first layer, sigmoid
grouped routing with a correction bias and a shared expert; logits and greedy tokens
against transformers; the latent cache (kv_lora_rank + qk_rope_head_dim values per
position) and the absorbed decode against the expanded prefill; the release-named MTP
layer into the sidecar, its block against transformers' ``DeepseekV3DecoderLayer``, and
speculative decoding equal to greedy."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cortiq_engine import Engine, SamplingConfig, SpeculativeConfig, forward
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.layers import Step
from cortiq_engine.mla import ABSORB_ROWS, MlaCache
from cortiq_engine.models import deepseek_v3, parse_config
from formats.cmf import CmfFile
from formats.errors import CortiqError
from tests import arch_tiny
from tests.tiny import build_tiny

MT = "deepseek_v3"
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    mscale=0.707,
    mscale_all_dim=1.0,
    beta_fast=32,
    beta_slow=1,
)
BASE = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    moe_intermediate_size=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
    routed_scaling_factor=2.5,
    rope_parameters=YARN,
)
# The release's shape (q LoRA, interleaved rotary pairs), and q_proj straight from the
# hidden state with the rotary parts in halves.
VARIANTS = {
    "q_lora": dict(BASE, q_lora_rank=32, rope_interleave=True),
    "q_proj": dict(BASE, q_lora_rank=None, rope_interleave=False),
}


def build(variant: str, seed: int = 0):
    """The transformers model; the routing bias randomized (the init leaves it at zero)."""
    import torch

    model = build_tiny(MT, seed=seed, **VARIANTS[variant])
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.2)
    return model


def save_checkpoint(folder, model_type: str = MT, mtp: bool = False):
    """The "q_lora" variant as an HF folder under ``folder``; ``model_type`` "kimi_k2" relabels
    it as Kimi K2 ships it; ``mtp``: with the release-named MTP layer (test_families' cases)."""
    from pathlib import Path

    folder = Path(folder)
    src = arch_tiny.save(build("q_lora"), folder / "trunk")
    if model_type != MT:
        cfg = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    return _with_mtp(src, folder / "mtp") if mtp else src


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """variant -> (transformers model, HF folder, f32 CMF)."""
    root = tmp_path_factory.mktemp("deepseek_v3")
    out = {}
    for v in VARIANTS:
        model = build(v)
        src = arch_tiny.save(model, root / v)
        cmf = root / f"{v}.cmf"
        convert_checkpoint(src, cmf, quant="f32")
        out[v] = (model, src, cmf)
    return out


def test_arch_parsed_from_config(ds):
    arch = parse_config(json.loads((ds["q_lora"][1] / "config.json").read_text()))
    m = arch.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, 32, 16, 8, 16)
    assert (
        m.rope_interleave
        and not parse_config(json.loads((ds["q_proj"][1] / "config.json").read_text())).mla.q_lora_rank
    )
    assert (arch.head_dim, arch.v_head_dim, arch.rotary_dim, arch.num_kv_heads) == (24, 16, 8, 4)
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["mscale_all_dim"] == 1.0
    mc = arch.moe
    assert (mc.scoring, mc.score_bias, mc.n_group, mc.topk_group, mc.moe_layers) == ("sigmoid", True, 2, 1, [1, 2])
    assert (mc.shared_expert_intermediate_size, mc.shared_expert_gate, mc.norm_topk_prob) == (32, False, True)
    assert mc.routed_scaling_factor == 2.5


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "rope scaling type"),
    ],
)
def test_unsupported_settings_are_refused(ds, edit, message):
    cfg = json.loads((ds["q_lora"][1] / "config.json").read_text())
    with pytest.raises(CortiqError, match=message):
        parse_config({**cfg, **edit})
    cfg.pop("q_lora_rank")
    with pytest.raises(CortiqError, match="q_lora_rank"):
        parse_config(cfg)


def test_kimi_k2_is_the_same_architecture(ds, tmp_path):
    """Kimi K2's config (model_type kimi_k2) parses and runs as DeepSeek-V3."""
    model, _, _ = ds["q_lora"]
    src = save_checkpoint(tmp_path / "kimi", "kimi_k2")
    assert parse_config(json.loads((src / "config.json").read_text())).arch == "deepseek_v3"
    convert_checkpoint(src, tmp_path / "k.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24)
    with Engine.load(tmp_path / "k.cmf", kernels="numpy") as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 1e-4


def test_yarn_tables_and_score_scale_match_transformers(ds):
    """cos/sin factor, frequencies and the score scale (mscale_all_dim squared) as
    transformers computes them; the test config makes each differ from plain RoPE."""
    model, src, cmf = ds["q_lora"]
    with Engine.load(cmf, kernels="numpy") as eng:
        attn = eng.model.blocks[0].attn
        rope = attn.rope
        cache = eng.new_state(8).caches[0]
    hf = model.model.rotary_emb
    np.testing.assert_allclose(rope.inv_freq, hf.inv_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12) and rope.attention_factor != 1.0
    assert attn.call.scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
    assert rope.score_factor != 1.0
    assert isinstance(cache, MlaCache)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(ds, variant, kernels):
    model, _, cmf = ds[variant]
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(ds, variant):
    import torch

    model, _, cmf = ds[variant]
    ids = arch_tiny.sample_ids(8, seed=3)
    with Engine.load(cmf) as eng:
        got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=16, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 8:].tolist()
    assert got == ref


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_absorbed_and_expanded_forms_agree(ds, kernels):
    """A prefill in the absorbed form, in the expanded form, and token by token (absorbed
    decode over the cache a step at a time): the same logits."""
    ids = arch_tiny.sample_ids(24, seed=1)
    assert len(ids) > ABSORB_ROWS  # the default picks the expanded form for this prefill
    for variant in VARIANTS:
        model, _, cmf = ds[variant]
        with Engine.load(cmf, kernels=kernels) as eng:
            outs = []
            for absorb in (True, False):
                m = deepseek_v3.build(eng.cmf, eng.arch, eng.kernels, absorb=absorb)
                outs.append(m.lm_head(m.final_norm(forward(m.new_state(32), ids))))
                # Two chunks: the second attends over latents the first one cached.
                st = m.new_state(32)
                chunks = np.concatenate([forward(st, ids[:10]), forward(st, ids[10:])])
                assert arch_tiny.rel_err(m.lm_head(m.final_norm(chunks)), outs[-1]) < 1e-5
            st = eng.new_state(32)
            steps = np.concatenate([eng.model.lm_head(eng.model.final_norm(forward(st, [i]))) for i in ids])
        assert arch_tiny.rel_err(outs[0], outs[1]) < 1e-5
        assert arch_tiny.rel_err(steps, outs[1]) < 1e-5
        assert arch_tiny.rel_err(outs[0], arch_tiny.torch_logits(model, ids)) < 1e-4


def test_latent_cache_holds_the_latent_and_the_rotary_key(ds):
    """kv_lora_rank + qk_rope_head_dim values per position (32 + 8 here, against 4 heads x
    (24 + 16) for expanded keys and values); append / truncate / keep_last / f16 like KVCache."""
    _, src, cmf = ds["q_lora"]
    cfg = json.loads((src / "config.json").read_text())
    per_pos = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    ids = arch_tiny.sample_ids(20, seed=2)
    with Engine.load(cmf, kernels="numpy") as eng:
        st = eng.new_state(32)
        full = forward(st, ids)
        for c in st.caches:
            assert isinstance(c, MlaCache) and c.keys.shape == (1, 32, per_pos) and c.values is c.keys
            assert c.keys[:, : c.length].size == len(ids) * per_pos and c.writes == len(ids)
        # Speculative rollback: truncate then re-forward gives the same rows.
        st.truncate(15)
        again = forward(st, ids[15:])
        assert np.array_equal(again, full[15:]) or arch_tiny.rel_err(again, full[15:]) < 1e-6
        st.evict(8)
        assert all(c.length == 8 for c in st.caches)
        assert np.isfinite(forward(st, [1, 2])).all()
    with Engine.load(cmf, kernels="numpy", kv_cache="f16") as eng:
        st = eng.new_state(32)
        half = forward(st, ids)
        assert st.caches[0].keys.dtype == np.float16 and st.caches[0].keys.shape == (1, 32, per_pos)
    assert arch_tiny.rel_err(half, full) < 1e-2


def test_q8_stays_close(ds, tmp_path):
    model, src, _ = ds["q_lora"]
    out = tmp_path / "q8.cmf"
    convert_checkpoint(src, out, quant="q8")
    ids = arch_tiny.sample_ids(24)
    with Engine.load(out) as eng:
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids))
    assert 1e-5 < err < 0.05


def test_interleave_and_routing_bias_matter(ds, tmp_path):
    """The checks can fail: the rotary pairs read as halves, or a zero routing bias,
    move the logits away from transformers'."""
    model, src, _ = ds["q_lora"]
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    cfg = json.loads((src / "config.json").read_text())
    t = load_file(str(src / "model.safetensors"))
    edits = {
        "halves": ({**cfg, "rope_interleave": False}, t),
        "no_bias": (cfg, {k: (np.zeros_like(v) if k.endswith("e_score_correction_bias") else v) for k, v in t.items()}),
    }
    for name, (c, tensors) in edits.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(c))
        (folder / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
        save_file(tensors, str(folder / "model.safetensors"))
        convert_checkpoint(folder, folder / "m.cmf", quant="f32")
        with Engine.load(folder / "m.cmf", kernels="numpy") as eng:
            assert arch_tiny.rel_err(eng.logits(ids), ref) > 1e-3, name


# ------------------------------------------------------------------ MTP
def _with_mtp(src, folder, seed: int = 5):
    """``src`` plus the release's MTP layer ``model.layers.{N}.*``: a trunk MoE layer's
    tensors (release names: per-expert, ``shared_experts``) perturbed, the draft ends,
    and the per-layer embedding / head copies the converter drops."""
    shutil.copytree(src, folder)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    trunk = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(seed)
    lay, p = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = {}
    for name, t in trunk.items():
        if name.startswith(lay):
            noise = 0.3 * float(np.std(t)) if t.ndim > 1 else 0.1
            out[p + name[len(lay) :]] = (t + noise * rng.standard_normal(t.shape)).astype(np.float32)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{p}{name}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    out[p + "eh_proj.weight"] = (rng.standard_normal((h, 2 * h)) * 0.1).astype(np.float32)
    out[p + "embed_tokens.weight"] = trunk["model.embed_tokens.weight"].copy()
    out[p + "shared_head.head.weight"] = trunk["lm_head.weight"].copy()
    save_file(out, str(folder / "mtp.safetensors"))
    return folder


@pytest.fixture(scope="module")
def ds_mtp(ds, tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3_mtp")
    src = _with_mtp(ds["q_lora"][1], root / "hf")
    out = root / "m.cmf"
    rep = convert_checkpoint(src, out, quant="f32")
    return src, out, rep


def test_mtp_layer_goes_to_the_sidecar(ds_mtp):
    src, out, rep = ds_mtp
    assert rep.sidecar is not None
    with CmfFile(out) as main, CmfFile(rep.sidecar) as side:
        assert not any(".mtp." in n for n in main.names())
        names = set(side.names())
        p = "model.mtp.layers.0."
        for n in (
            "final_layernorm.weight",
            "eh_proj.weight",
            "enorm.weight",
            "mlp.shared_expert.gate_proj.weight",
            "mlp.gate.e_score_correction_bias",
            "mlp.experts.7.down_proj.weight",
            "self_attn.q_a_proj.weight",
            "self_attn.kv_b_proj.weight",
            "self_attn.kv_a_layernorm.weight",
        ):
            assert p + n in names, n
        assert not any("embed_tokens" in n or "shared_head" in n for n in names)
        assert side.header["arch"]["mtp"] == {"num_layers": 1, "style": "deepseek"}


def test_mtp_block_against_transformers_decoder_layer(ds_mtp):
    """The draft block (latent attention, routed FFN with the shared expert) against
    transformers' ``DeepseekV3DecoderLayer`` at the MTP layer's index, loaded with the
    draft weights; the backbone hidden rows come from the engine."""
    import torch
    from transformers import AutoConfig
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dm

    src, out, _ = ds_mtp
    ids = arch_tiny.sample_ids(20, seed=4)
    with Engine.load(out, kernels="numpy", mtp=True) as eng:
        hidden = forward(eng.new_state(32), ids)
        layer = eng.drafts.layers[0]
        k = len(ids) - 1
        emb = eng.model.embed_ids(ids[1:])
        u = layer(eng.kernels, emb, hidden[:k], layer.make_cache(32), Step(np.arange(k)))
        got = eng.model.lm_head(layer.final_norm(u))

    cfg = AutoConfig.from_pretrained(src)
    cfg._attn_implementation = "eager"
    n = cfg.num_hidden_layers
    w = {name: torch.from_numpy(v) for name, v in load_file(str(src / "mtp.safetensors")).items()}
    p = f"model.layers.{n}."
    sd = {name[len(p) :]: v for name, v in w.items() if name.startswith(p)}
    ex = lambda e, x: sd.pop(f"mlp.experts.{e}.{x}_proj.weight")  # noqa: E731
    E = cfg.n_routed_experts
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([ex(e, "gate"), ex(e, "up")]) for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([ex(e, "down") for e in range(E)])
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = dm.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": sd.pop(f"{name}.weight")})
    eh = sd.pop("eh_proj.weight")
    head = sd.pop("shared_head.head.weight")
    sd.pop("embed_tokens.weight")
    block = dm.DeepseekV3DecoderLayer(cfg, n).eval()
    block.load_state_dict(sd)
    with torch.no_grad():
        x = torch.cat([norms["enorm"](torch.from_numpy(emb)), norms["hnorm"](torch.from_numpy(hidden[:k]))], -1) @ eh.T
        pos = torch.arange(k)[None]
        pe = dm.DeepseekV3RotaryEmbedding(cfg)(x[None], pos)
        mask = torch.full((k, k), float("-inf")).triu(1)[None, None]
        y = block(x[None], position_embeddings=pe, attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        want = (norms["shared_head.norm"](y[0]) @ head.T).numpy()
    assert arch_tiny.rel_err(got, want) < 1e-4


def test_speculative_with_the_deepseek_sidecar_equals_greedy(ds_mtp):
    _, out, _ = ds_mtp
    with Engine.load(out, mtp=True) as eng:
        stack = eng.drafts
        assert stack is not None and stack.num_layers == 1 and stack.style == "deepseek"
        prompt = arch_tiny.sample_ids(12, seed=3)
        plain = eng.generate(prompt, max_tokens=20, ignore_eos=True, speculative=False).token_ids
        # threshold 0: the random draft layer would otherwise propose nothing.
        for depth in (1, 3):
            res = eng.generate(
                prompt,
                max_tokens=20,
                ignore_eos=True,
                speculative=SpeculativeConfig(depth=depth, threshold=0, lookup=0),
            )
            assert res.token_ids == plain
            assert res.extra["mtp"]["rounds"] > 0 and res.expert_usage


def test_mtp_layer_with_wrong_latent_geometry_is_refused(ds, tmp_path):
    src = _with_mtp(ds["q_lora"][1], tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    t = load_file(str(src / "mtp.safetensors"))
    name = f"model.layers.{cfg['num_hidden_layers']}.self_attn.kv_b_proj.weight"
    t[name] = t[name][:, :16].copy()  # a latent of 16 where kv_lora_rank says 32
    save_file(t, str(src / "mtp.safetensors"))
    with pytest.raises(CortiqError, match="kv_b_proj"):
        convert_checkpoint(src, tmp_path / "bad.cmf", quant="f32")


# ------------------------------------------------------------------ GGUF (llama.cpp's deepseek2)
# llama.cpp's deepseek2 rotates adjacent pairs and its converter keeps q / kv_a rows as
# shipped, so a GGUF holds the release's interleaved layout; its YaRN leaves cos/sin
# unscaled (mscale == mscale_all_dim, as in the releases).
GGUF_VARIANTS = {
    "q_lora": dict(VARIANTS["q_lora"], rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0)),
    "q_proj": dict(
        VARIANTS["q_proj"], rope_interleave=True, rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0)
    ),
}


def build_gguf_source(variant: str, seed: int = 2):
    import torch

    model = build_tiny(MT, seed=seed, **GGUF_VARIANTS[variant])
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.2)
    return model


def write_deepseek2_gguf(
    model, path, weight_type: str = "F32", split_kv_b: bool | str = True, meta: dict | None = None
):
    """The GGUF llama.cpp's DeepseekV2Model writes: MLA as one KV head (key_length
    kv_lora_rank + rope, the real sizes in *_mla), experts stacked [experts, rows, cols],
    the routing bias as exp_probs_b.bias, YaRN's mscale_all_dim as 0.1 * it in
    yarn_log_multiplier, q / kv_a rows unpermuted; ``split_kv_b``: attn_kv_b split per
    head into attn_k_b (transposed) and attn_v_b as newer converters do ("both": and
    attn_kv_b too), else attn_kv_b whole as older ones. ``meta``: ``deepseek2.*`` keys to override (None drops one)."""
    import gguf
    from tokenizers import pre_tokenizers

    cfg = model.config
    rp = cfg.rope_parameters
    rope_dim, nope, vd, rank = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    keys = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": 1,
        "rope.freq_base": float(rp["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_group_count": cfg.n_group,
        "expert_group_used_count": cfg.topk_group,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "leading_dense_block_count": cfg.first_k_dense_replace,
        "vocab_size": cfg.vocab_size,
        "attention.kv_lora_rank": rank,
        "attention.key_length": rank + rope_dim,
        "attention.value_length": rank,
        "attention.key_length_mla": nope + rope_dim,
        "attention.value_length_mla": vd,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_count": cfg.n_routed_experts,
        "expert_shared_count": cfg.n_shared_experts,
        "expert_weights_scale": float(cfg.routed_scaling_factor),
        "expert_weights_norm": bool(cfg.norm_topk_prob),
        "rope.dimension_count": rope_dim,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rp["factor"]),
        "rope.scaling.original_context_length": rp["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": float(rp["beta_fast"]),
        "rope.scaling.yarn_beta_slow": float(rp["beta_slow"]),
        "rope.scaling.yarn_log_multiplier": 0.1 * rp["mscale_all_dim"],
    }
    if cfg.q_lora_rank:
        keys["attention.q_lora_rank"] = cfg.q_lora_rank
    keys.update(meta or {})
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, bool):
            w.add_bool(f"deepseek2.{k}", v)
        elif isinstance(v, str):
            w.add_string(f"deepseek2.{k}", v)
        elif isinstance(v, float):
            w.add_float32(f"deepseek2.{k}", v)
        else:
            w.add_uint32(f"deepseek2.{k}", v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    w.add_token_types([1] * 256)

    def add(name, x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        if weight_type != "F32" and x.ndim >= 2 and x.shape[-1] % 32 == 0:
            qt = gguf.GGMLQuantizationType[weight_type]
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, x)

    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    }
    for name, t in model.state_dict().items():
        x = t.detach().numpy().astype(np.float32)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            add(
                {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[name],
                x,
            )
            continue
        _, _, layer, rest = name.split(".", 3)
        b = f"blk.{layer}."
        if rest == "mlp.gate.e_score_correction_bias":
            add(b + "exp_probs_b.bias", x)
        elif rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            inter = x.shape[1] // 2
            add(b + "ffn_gate_exps.weight", x[:, :inter])
            add(b + "ffn_up_exps.weight", x[:, inter:])
        elif rest == "mlp.experts.down_proj":
            add(b + "ffn_down_exps.weight", x)
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = x.reshape(cfg.num_attention_heads, nope + vd, rank)
            add(b + "attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1))  # [heads, rank, nope]
            add(b + "attn_v_b.weight", kv_b[:, nope:])  # [heads, v, rank]
            if split_kv_b == "both":
                add(b + "attn_kv_b.weight", x)
        else:
            module, kind = rest.rsplit(".", 1)
            add(f"{b}{parts[module]}.{kind}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "variant,weight_type,split",
    [("q_lora", "F32", True), ("q_lora", "F32", "both"), ("q_proj", "F32", False), ("q_lora", "Q8_0", True)],
)
def test_gguf_matches_transformers(tmp_path, variant, weight_type, split):
    """A deepseek2 GGUF as llama.cpp's converter writes it (kv_b whole or split per head
    into k_b / v_b, q with and without its LoRA) converts to the source model."""
    src = build_gguf_source(variant)
    path = write_deepseek2_gguf(src, tmp_path / "d.gguf", weight_type, split)
    convert_checkpoint(path, tmp_path / "d.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(src, ids)
    with Engine.load(tmp_path / "d.cmf", kernels="numpy") as eng:
        arch = eng.arch
        err = arch_tiny.rel_err(eng.logits(ids), ref)
        attn = eng.model.blocks[0].attn
        assert (attn.w.kv_b is None) == (split is True)
        st = eng.new_state(32)  # absorbed decode a token at a time over the same cache
        steps = np.concatenate([eng.model.lm_head(eng.model.final_norm(forward(st, [i]))) for i in ids])
    want = parse_config(json.loads(src.config.to_json_string()))
    assert (arch.mla, arch.moe, arch.rope_scaling["mscale_all_dim"]) == (want.mla, want.moe, 1.0)
    assert err < (1e-4 if weight_type == "F32" else 0.05), err
    assert arch_tiny.rel_err(steps, ref) < (1e-4 if weight_type == "F32" else 0.05)
    if weight_type != "F32":  # q8 straight from the Q8_0 blocks
        convert_checkpoint(path, tmp_path / "q8.cmf", quant="q8")
        with Engine.load(tmp_path / "q8.cmf", kernels="numpy") as eng:
            assert 1e-5 < arch_tiny.rel_err(eng.logits(ids), ref) < 0.05


def test_gguf_without_the_mla_keys_and_refusals(tmp_path):
    """An older deepseek2 GGUF (no *_mla keys: the real head sizes in key/value_length,
    every head a KV head) imports alike; DeepSeek-V2's softmax routing (no
    expert_gating_func), a missing routing bias, and latent attention without any kv_b
    form are refused by name."""
    from cortiq_engine.convert import import_gguf

    src = build_gguf_source("q_lora")
    cfg = src.config
    old = {
        "attention.key_length_mla": None,
        "attention.value_length_mla": None,
        "attention.head_count_kv": 4,
        "attention.key_length": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "attention.value_length": cfg.v_head_dim,
    }
    path = write_deepseek2_gguf(src, tmp_path / "old.gguf", split_kv_b=False, meta=old)
    convert_checkpoint(path, tmp_path / "old.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24)
    with Engine.load(tmp_path / "old.cmf", kernels="numpy") as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(src, ids)) < 1e-4
    bad = write_deepseek2_gguf(src, tmp_path / "v2.gguf", meta={"expert_gating_func": None})
    with pytest.raises(CortiqError, match="expert_gating_func None is not supported"):
        convert_checkpoint(bad, tmp_path / "v2.cmf", quant="f32")
    import_gguf(path, tmp_path / "hf")
    t = load_file(str(tmp_path / "hf" / "model.safetensors"))
    no_bias = {k: v for k, v in t.items() if "e_score_correction" not in k}
    save_file(no_bias, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CortiqError, match="missing tensor model.layers.1.mlp.gate.e_score_correction_bias"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "nb.cmf", quant="f32")
    save_file(
        {k: v for k, v in t.items() if "layers.0.self_attn.kv_b_proj" not in k},
        str(tmp_path / "hf" / "model.safetensors"),
    )
    convert_checkpoint(tmp_path / "hf", tmp_path / "nokv.cmf", quant="f32")
    with pytest.raises(CortiqError, match="needs kv_b_proj or, per head, k_b_proj and v_b_proj"):
        Engine.load(tmp_path / "nokv.cmf", kernels="numpy")


def test_ctx_memory_check_counts_the_latent_row(ds):
    """--ctx is sized by the latent cache row (kv_lora_rank + qk_rope_head_dim per layer,
    32 + 8 here), not by per-head keys and values (4 x (24 + 16)): a context whose
    latent caches fit is accepted although expanded ones would not fit."""
    import os

    from cortiq_engine.engine import check_ctx_memory

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with Engine.load(ds["q_lora"][2], kernels="numpy") as eng:
        a = eng.arch
        latent = a.num_layers * (a.mla.kv_lora_rank + a.mla.qk_rope_head_dim) * 4
        expanded = a.num_layers * a.num_kv_heads * (a.head_dim + a.v_head_dim) * 4
        ctx = total // (2 * latent)  # half the memory as latent rows, twice of it expanded
        assert ctx * expanded > total
        check_ctx_memory(eng.model, ctx)
        with pytest.raises(CortiqError, match=f"--ctx {3 * ctx} needs"):
            check_ctx_memory(eng.model, 3 * ctx)


@pytest.mark.parametrize("backend", ["torch", "engine"])
def test_mtp_train_refuses_a_latent_attention_trunk(ds, tmp_path, backend):
    """mtp-train's llama-style draft layers cannot start from (or be loaded as) latent
    attention blocks: one line naming why, whichever backend collects the rows."""
    from pathlib import Path

    from cortiq_train.config import TrainConfig
    from cortiq_train.run import train_mtp

    text = (Path(__file__).resolve().parents[1] / "evals" / "data" / "alice.txt").read_text(encoding="utf-8")[:1000]
    cfg = TrainConfig(
        layers=1,
        steps=2,
        seq=32,
        batch=2,
        warmup=1,
        topk=8,
        holdout=0.2,
        max_tokens=400,
        checkpoint_every=0,
        negatives=16,
    )
    with pytest.raises(CortiqError, match="llama-style draft layers .* multi-head latent attention"):
        train_mtp(
            ds["q_lora"][2],
            text,
            "alice",
            cfg,
            out=tmp_path / "d.mtp.cmf",
            kernels="numpy",
            backend=backend,
            work=tmp_path / "work",
        )
