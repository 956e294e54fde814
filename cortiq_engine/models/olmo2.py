"""OLMo 2: a post-norm block, x += norm(attn(x)); x += norm(mlp(x)) (no norm before
either sublayer); q/k RMS norms over the whole projection width (all heads at once,
before the split into heads: q_norm has num_heads * head_dim values, k_norm
num_kv_heads * head_dim); RoPE; a SwiGLU MLP; plain (w) RMS norms.

Follows transformers' ``models/olmo2/modeling_olmo2.py`` (the oracle of the tests).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from formats.arch import LAYER_FULL, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from formats.manifest import Manifest
from cortiq_engine.layers import Attention, SandwichBlock
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import Family, Geometry, dense_common
from cortiq_engine.weights import load_vector

NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


# ------------------------------------------------------------------ config.json
def _olmo2(cfg: dict[str, Any]) -> ArchConfig:
    """OLMo 2: every layer full attention; ``qk_norm`` stays False because the family's
    q/k norms are the full-width kind, which ``arch.arch == "olmo2"`` implies."""
    d = dense_common(cfg, "olmo2")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    # transformers' Olmo2Config defaults rms_norm_eps to 1e-5, not dense_common's 1e-6.
    d["norm_eps"] = float(cfg["rms_norm_eps"]) if cfg.get("rms_norm_eps") is not None else 1e-5
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def qk_norms(p: str, g: Geometry) -> Manifest:
    """The full-width q/k norms of the attention under prefix ``p``."""
    return Manifest(
        {
            f"{p}self_attn.q_norm.weight": (g.num_heads * g.head_dim,),
            f"{p}self_attn.k_norm.weight": (g.num_kv_heads * g.head_dim,),
        }
    )


def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Per layer: attention (optional biases) with its full-width q/k norms, the two
    post-sublayer norms, the SwiGLU MLP. Draft layers (none ship with OLMo 2; mtp-train
    can make them) are pre-norm draft blocks."""
    h, m, g = arch.hidden_size, base.trunk_ends(arch), Geometry.full(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        m.update(base.norms(p, h, *NORMS))
        m.update(base.attention(p, h, g))
        m.update(qk_norms(p, g))
        m.update(base.gated_mlp(p + "mlp.", h, arch.intermediate_size))
    return m.update(blocks.draft_manifests(arch, mtp_layers))


# ------------------------------------------------------------------ the model
def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    """Refuse header fields an OLMo 2 never has: the build would not honour them."""
    if arch.moe is not None or arch.linear_attn is not None or arch.sliding is not None or arch.mla is not None:
        raise CortiqError(f"{cmf.path}: olmo2 with MoE, linear, MLA or split-geometry layers is not an OLMo 2 model")
    if any(t != LAYER_FULL for t in arch.layer_types) or arch.sliding_window:
        raise CortiqError(f"{cmf.path}: olmo2 has full attention in every layer, the header asks for other layer types")
    if arch.qk_norm or arch.attention_sinks or arch.attn_output_gate or arch.attention_scale or arch.no_rope_layers:
        raise CortiqError(
            f"{cmf.path}: olmo2 with per-head q/k norms, sinks, an output gate, a score scale or NoPE layers is not an OLMo 2 model"
        )
    if arch.attn_logit_softcapping or arch.final_logit_softcapping or arch.query_pre_attn_scalar:
        raise CortiqError(f"{cmf.path}: olmo2 has no soft-caps and no query_pre_attn_scalar")
    if (
        arch.norm_style != "rms"
        or arch.embedding_scale != 1.0
        or arch.residual_scale != 1.0
        or arch.logits_scaling != 1.0
    ):
        raise CortiqError(f"{cmf.path}: olmo2 norms scale by w and it has no Granite multipliers")


def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, rope) -> Attention:
    """Full attention with q/k norms over the whole projection (``Attention(qk_norm_full=True)``)."""
    g = Geometry.full(arch)
    aw = blocks.attention_weights(cmf, p, arch, qk_norm=False)
    aw = replace(
        aw,
        q_norm=load_vector(cmf, f"{p}self_attn.q_norm.weight", g.num_heads * g.head_dim),
        k_norm=load_vector(cmf, f"{p}self_attn.k_norm.weight", g.num_kv_heads * g.head_dim),
    )
    return Attention(
        kernels,
        aw,
        num_heads=g.num_heads,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        v_head_dim=g.v_head_dim,
        rope=rope,
        norm_eps=arch.norm_eps,
        qk_norm_full=True,
    )


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    _check(cmf, arch)
    rope = blocks.rope(arch)
    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for x in ("gate", "up", "down"):
            if f"{p}mlp.{x}_proj.bias" in cmf:
                raise CortiqError(f"{cmf.path}: MLP biases are not part of OLMo 2")
        post_attn, post_ffn = (blocks.norm(cmf, arch, kernels, f"{p}{n}.weight") for n in NORMS)
        # No pre-norms: each sublayer reads the residual stream itself.
        layers.append(
            SandwichBlock(
                (None, post_attn, None, post_ffn),
                attention(cmf, arch, kernels, p, rope),
                blocks.gated_mlp(cmf, kernels, f"{p}mlp."),
            )
        )
    embed, head, norm = blocks.head_and_norm(cmf, arch, kernels)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(layers), norm=norm, head=head)


# ------------------------------------------------------------------ GGUF
def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """OLMo 2's config.json: the common fields are all it has. llama.cpp also files
    OLMo 3 (sliding-window layers) under olmo2; such a file is refused."""
    hd = config["head_dim"]
    if int(ctx.key("attention.value_length", hd)) != hd:
        raise CortiqError("GGUFs with different key and value head sizes are not supported")
    if int(ctx.key("rope.dimension_count", hd)) != hd:
        raise CortiqError("partial rotary embeddings (rope.dimension_count < head size) are not supported")
    if ctx.key("attention.sliding_window") is not None:
        raise CortiqError("olmo2 GGUFs with olmo2.attention.sliding_window (OLMo 3) are not supported")
    bias = [f"blk.0.attn_{p}.bias" in ctx.tensors for p in ("q", "k", "v", "output")]
    if any(bias) and not all(bias):
        raise CortiqError("GGUFs with biases on only some attention projections are not supported")


GGUF = GgufSpec(
    "olmo2",
    "olmo2",
    "Olmo2ForCausalLM",
    # Only the post-sublayer norms; q/k norms keep the shared names (attn_q_norm / attn_k_norm).
    block_names={"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    config=_gguf_config,
)


FAMILY = Family(
    name="olmo2",
    parsers={"olmo2": _olmo2},
    archs=("olmo2",),
    manifest=manifest,
    build=build,
    draft_layer=blocks.dense_draft_layer,
    hf_architectures=("Olmo2ForCausalLM",),
    gguf=(GGUF,),
)
