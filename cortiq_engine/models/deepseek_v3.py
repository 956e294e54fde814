"""DeepSeek-V3 and DeepSeek-R1 (``deepseek_v3``), Kimi K2 (``kimi_k2``, the same architecture):
multi-head latent attention (``cortiq_engine.mla``) in every layer, a dense SwiGLU MLP on the first
``first_k_dense_replace`` layers and a sigmoid-routed MoE after them (a learned choice
bias, ``n_group`` groups of which ``topk_group`` are eligible, weights renormalized and
scaled by ``routed_scaling_factor``) plus always-on shared experts.

RoPE covers only each head's ``qk_rope_head_dim`` part, YaRN-scaled in the releases; the
score scale is qk_head_dim**-0.5 times YaRN's ``mscale_all_dim`` factor. With
``rope_interleave`` (the releases' layout, transformers' default) the rotary parts are
de-interleaved at run time (``mla``'s module doc); the weights are stored as shipped.

Checkpoint names: ``mlp.shared_experts.*`` -> ``mlp.shared_expert.*`` (one SwiGLU of
``moe_intermediate_size * n_shared_experts``, no gate); transformers' fused
``mlp.experts.gate_up_proj`` / ``down_proj`` are split per expert.

MTP: ``num_nextn_predict_layers`` layers stored as ``model.layers.{N + k}.*``
(``formats.mtp_names`` moves them to ``model.mtp.layers.{k}.*``); each is the trunk's
block, latent attention over the MoE FFN, between the shared draft ends.

GGUF: llama.cpp's ``deepseek2`` (its converter's DeepseekV2Model, see ``GGUF`` below).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from formats.arch import LAYER_FULL, ArchConfig, MlaConfig, MoeConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import MOE_BLOCK_NAMES, ROUTING_BIAS, GgufContext, GgufSpec
from formats.manifest import Manifest
from cortiq_engine.layers import RoPE
from cortiq_engine.mla import MlaAttention, MlaWeights, mla_manifest
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import DraftLayer, dense_common, draft_prefix, req
from cortiq_engine.weights import load_vector, load_weight

# transformers' DeepseekV3Config defaults, for a config.json that leaves a key out.
_DEFAULTS = dict(
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    rope_interleave=True,
)


# ------------------------------------------------------------------ config.json
def _opt(cfg: dict[str, Any], key: str) -> Any:
    v = cfg.get(key)
    return _DEFAULTS[key] if v is None else v


def _deepseek_v3(cfg: dict[str, Any]) -> ArchConfig:
    """DeepSeek-V3 / R1 (``deepseek_v3``) and Kimi K2 (``kimi_k2``: the same architecture
    and names, its own routing sizes)."""
    mt = cfg.get("model_type")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, want):
            raise CortiqError(f"config.json {key} {cfg[key]!r} is not supported for {mt} (supported: {want})")
    if cfg.get("moe_layer_freq") not in (None, 1):
        raise CortiqError(
            f"config.json moe_layer_freq {cfg['moe_layer_freq']!r} is not supported (every layer past first_k_dense_replace is MoE)"
        )
    if "q_lora_rank" not in cfg:
        raise CortiqError("config.json has no 'q_lora_rank' (null when q_proj reads the hidden state directly)")
    flat = {k: v for k, v in cfg.items() if k not in ("head_dim", "partial_rotary_factor")}
    d = dense_common(flat, "deepseek_v3")
    n, heads = d["num_layers"], d["num_heads"]
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        raise CortiqError(
            f"config.json num_key_value_heads {kv_heads} != num_attention_heads {heads}: latent attention expands every head"
        )
    mla = MlaConfig(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(req(cfg, "kv_lora_rank")),
        qk_nope_head_dim=int(req(cfg, "qk_nope_head_dim")),
        qk_rope_head_dim=int(req(cfg, "qk_rope_head_dim")),
        v_head_dim=int(req(cfg, "v_head_dim")),
        rope_interleave=bool(_opt(cfg, "rope_interleave")),
    )
    if cfg.get("q_lora_rank") is not None and mla.q_lora_rank < 1:
        raise CortiqError(f"config.json q_lora_rank {cfg['q_lora_rank']!r} is not a positive size (null for none)")
    # The header's head geometry: full query/key heads of nope + rope, values of v_head_dim.
    d["num_kv_heads"] = heads
    d["head_dim"] = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    d["v_head_dim"] = mla.v_head_dim
    d["rotary_dim"] = mla.qk_rope_head_dim
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["mla"] = mla
    experts = int(req(cfg, "n_routed_experts"))
    dense = int(_opt(cfg, "first_k_dense_replace"))
    moe_inter = int(req(cfg, "moe_intermediate_size"))
    d["moe"] = MoeConfig(
        num_experts=experts,
        top_k=int(req(cfg, "num_experts_per_tok")),
        expert_intermediate_size=moe_inter,
        norm_topk_prob=bool(_opt(cfg, "norm_topk_prob")),
        shared_expert_intermediate_size=moe_inter * int(_opt(cfg, "n_shared_experts")),
        shared_expert_gate=False,
        moe_layers=[i for i in range(n) if i >= dense],
        scoring="sigmoid",
        score_bias=True,
        n_group=int(_opt(cfg, "n_group")),
        topk_group=int(_opt(cfg, "topk_group")),
        routed_scaling_factor=float(_opt(cfg, "routed_scaling_factor")),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Pre-norm blocks of latent attention over each layer's FFN; the draft blocks route
    to experts like the layers they follow."""
    if arch.mla is None or arch.moe is None:
        raise CortiqError("a deepseek_v3 header needs its mla and moe sections")

    def attention(p: str, kind: str) -> Manifest:
        return mla_manifest(p, arch.hidden_size, arch.num_heads, arch.mla)

    trunk = blocks.prenorm_manifest(arch, attention)
    return trunk.update(blocks.draft_manifests(arch, mtp_layers, routed=True, attention=attention))


# ------------------------------------------------------------------ the trunk
def rope(arch: ArchConfig) -> RoPE:
    """The rotary part's embedding (YaRN with its cos/sin and score factors when configured)."""
    return RoPE(arch.mla.qk_rope_head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)


def _opt_vector(cmf: CmfFile, name: str) -> Any:
    return load_vector(cmf, name) if name in cmf else None


def _per_head(cmf: CmfFile, stem: str, heads: int) -> tuple | None:
    """``{stem}.{h}.weight`` for every head (llama.cpp's split kv_b), or None when absent."""
    if f"{stem}.0.weight" not in cmf:
        return None
    return tuple(load_weight(cmf, f"{stem}.{h}.weight") for h in range(heads))


def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, rope_: RoPE, absorb: bool | None = None) -> MlaAttention:
    """The latent attention of the block with prefix ``p``."""
    a, m = p + "self_attn.", arch.mla
    lora = m.q_lora_rank > 0
    # Some llama.cpp GGUFs carry kv_b whole and split alike: the whole one is read then.
    whole = a + "kv_b_proj.weight" in cmf
    w = MlaWeights(
        q_b=load_weight(cmf, a + ("q_b_proj.weight" if lora else "q_proj.weight")),
        kv_a=load_weight(cmf, a + "kv_a_proj_with_mqa.weight"),
        kv_a_norm=load_vector(cmf, a + "kv_a_layernorm.weight", m.kv_lora_rank),
        kv_b=load_weight(cmf, a + "kv_b_proj.weight") if whole else None,
        o=load_weight(cmf, a + "o_proj.weight"),
        q_a=load_weight(cmf, a + "q_a_proj.weight") if lora else None,
        q_a_norm=load_vector(cmf, a + "q_a_layernorm.weight", m.q_lora_rank) if lora else None,
        q_a_bias=_opt_vector(cmf, a + "q_a_proj.bias") if lora else None,
        kv_a_bias=_opt_vector(cmf, a + "kv_a_proj_with_mqa.bias"),
        o_bias=_opt_vector(cmf, a + "o_proj.bias"),
        k_b=None if whole else _per_head(cmf, a + "k_b_proj", arch.num_heads),
        v_b=None if whole else _per_head(cmf, a + "v_b_proj", arch.num_heads),
    )
    return MlaAttention(kernels, w, m, num_heads=arch.num_heads, rope=rope_, absorb=absorb)


# What a DeepSeek-V3 header may ask for (``base.SETTINGS``); the rest is refused.
COMPUTES = ("routed experts", "latent attention")


def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    if arch.mla is None or arch.moe is None:
        raise CortiqError(f"{cmf.path}: a deepseek_v3 header needs its mla and moe sections")
    if arch.moe.scoring != "sigmoid" or not arch.moe.score_bias or arch.moe.shared_expert_gate:
        raise CortiqError(
            f"{cmf.path}: deepseek_v3 routes by sigmoid scores with a choice bias and an ungated shared expert"
        )


def build(cmf: CmfFile, arch: ArchConfig, kernels, absorb: bool | None = None) -> Model:
    """The trunk; ``absorb`` forces one form of the latent attention (tests compare them)."""
    _check(cmf, arch)
    r = rope(arch)
    return blocks.prenorm_model(cmf, arch, kernels, mixer=lambda p, kind: attention(cmf, arch, kernels, p, r, absorb))


# ------------------------------------------------------------------ draft layers
def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k``: the trunk's block (latent attention, routed experts) between the draft ends."""
    base.refuse_header(cmf, arch, (LAYER_FULL,), COMPUTES)  # as Family.model does for the trunk
    _check(cmf, arch)
    p = draft_prefix(k)
    attn = attention(cmf, arch, kernels, p, rope(arch))
    return blocks.prenorm_draft(cmf, k, arch, kernels, attn, blocks.load_moe(cmf, arch, kernels, p))


# ------------------------------------------------------------------ GGUF
def _gguf_num(ctx: GgufContext, key: str, default: Any = None, *, integer: bool = False) -> Any:
    """``deepseek2.{key}`` as a typed, finite, non-negative number (``default`` when absent)."""
    v = ctx.key(key, default)
    if v is None:
        raise CortiqError(f"GGUF metadata has no 'deepseek2.{key}'")
    ok = not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(float(v))
    if not ok or float(v) < 0 or (integer and float(v) != int(v)):
        want = "integer" if integer else "number"
        raise CortiqError(f"GGUF metadata deepseek2.{key} is {str(v)[:40]!r}, expected a non-negative {want}")
    # A float32 in the file, as the decimal its author wrote (2.5, not 2.500000238...).
    return int(v) if integer else float(str(np.float32(v)))


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """DeepSeek-V3's config.json from llama.cpp's deepseek2 metadata.

    The converter writes the latent attention as one-KV-head attention over the cache
    row (head_count_kv 1, key_length kv_lora_rank + rope, value_length kv_lora_rank) and
    the real head sizes as key_length_mla / value_length_mla; older files have no *_mla
    keys and the real sizes in key_length / value_length. It does not permute q or
    kv_a rows: llama.cpp rotates adjacent pairs, the release's interleaved layout.
    What a key's absence means is what llama.cpp's deepseek2 graph then does: no
    routing groups, no weight renormalization, a routed scale of 1."""
    heads = config["num_attention_heads"]
    rope_dim = _gguf_num(ctx, "rope.dimension_count", integer=True)
    mla = ctx.key("attention.key_length_mla") is not None
    qk = _gguf_num(ctx, "attention.key_length_mla" if mla else "attention.key_length", integer=True)
    v = _gguf_num(ctx, "attention.value_length_mla" if mla else "attention.value_length", integer=True)
    if not 0 < rope_dim < qk or rope_dim % 2 or v < 1:
        raise CortiqError(
            f"deepseek2 GGUF head sizes (query/key {qk}, rotary {rope_dim}, value {v}) are not a latent attention geometry"
        )
    q_lora = "blk.0.attn_q_a.weight" in ctx.tensors
    gating = ctx.key("expert_gating_func", None)
    if gating != 2:  # gguf.ExpertGatingFuncType.SIGMOID; llama.cpp reads a missing key as softmax (DeepSeek-V2)
        raise CortiqError(
            f"deepseek2 GGUF expert_gating_func {gating!r} is not supported "
            "(DeepSeek-V2's softmax routing; supported: 2, sigmoid)"
        )
    dense = _gguf_num(ctx, "leading_dense_block_count", 0, integer=True)
    if dense < config["num_hidden_layers"] and f"blk.{dense}.exp_probs_b.bias" not in ctx.tensors:
        raise CortiqError(f"deepseek2 GGUF has no exp_probs_b (the routing bias) in its first MoE layer {dense}")
    for key in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
        if ctx.key(key, 1.0) != 1.0:
            raise CortiqError(
                f"deepseek2 GGUF {key} {ctx.key(key)!r} is not supported (transformers has no such factor)"
            )
    config.update(
        num_key_value_heads=heads,
        head_dim=rope_dim,  # DeepseekV3Config's head_dim is the rotary width
        q_lora_rank=_gguf_num(ctx, "attention.q_lora_rank", integer=True) if q_lora else None,
        kv_lora_rank=_gguf_num(ctx, "attention.kv_lora_rank", integer=True),
        qk_nope_head_dim=qk - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v,
        rope_interleave=True,
        first_k_dense_replace=dense,
        n_routed_experts=_gguf_num(ctx, "expert_count", integer=True),
        num_experts_per_tok=_gguf_num(ctx, "expert_used_count", integer=True),
        moe_intermediate_size=_gguf_num(ctx, "expert_feed_forward_length", integer=True),
        n_shared_experts=_gguf_num(ctx, "expert_shared_count", 0, integer=True),
        routed_scaling_factor=_gguf_num(ctx, "expert_weights_scale", 1.0),
        norm_topk_prob=bool(ctx.key("expert_weights_norm", False)),
        n_group=max(1, _gguf_num(ctx, "expert_group_count", 1, integer=True)),
        topk_group=max(1, _gguf_num(ctx, "expert_group_used_count", 1, integer=True)),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    rs = config.get("rope_scaling")
    if rs is not None:
        if rs.get("rope_type") != "yarn":
            raise CortiqError(f"deepseek2 GGUF rope scaling {rs.get('rope_type')!r} is not supported (supported: yarn)")
        # The converter stores 0.1 * mscale_all_dim; llama.cpp scales scores by its YaRN
        # factor squared and leaves cos/sin unscaled (mscale == mscale_all_dim).
        log_mul = _gguf_num(ctx, "rope.scaling.yarn_log_multiplier", 0.0)
        rs.update(
            beta_fast=_gguf_num(ctx, "rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=_gguf_num(ctx, "rope.scaling.yarn_beta_slow", 1.0),
            mscale=log_mul / 0.1,
            mscale_all_dim=log_mul / 0.1,
            attention_factor=1.0,
        )


# llama.cpp's deepseek2 block parts. Newer converters split attn_kv_b per head into
# attn_k_b [heads, kv_lora_rank, nope] (the key part, transposed) and attn_v_b
# [heads, v, kv_lora_rank]; they become per-head views the latent attention reads directly.
GGUF = GgufSpec(
    "deepseek2",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    block_names={
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj.{e}",
        "attn_v_b": "self_attn.v_b_proj.{e}",
        **MOE_BLOCK_NAMES,
    },
    full_names=ROUTING_BIAS,
    config=_gguf_config,
)


PARSERS = {"deepseek_v3": _deepseek_v3, "kimi_k2": _deepseek_v3}
KINDS = (LAYER_FULL,)
SANITIZE = base.SHARED_EXPERTS_RULES
MTP_STYLE = "deepseek"
