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
from formats.gguf_spec import SANDWICH_BLOCK_NAMES, GgufContext, GgufSpec
from formats.manifest import Manifest
from cortiq_engine.layers import Attention
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import Geometry, dense_common
from cortiq_engine.weights import load_vector

# No pre-norms: each sublayer reads the residual stream itself.
NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


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
    g = Geometry.full(arch)

    def attention(p: str) -> Manifest:
        return base.attention(p, arch.hidden_size, g).update(qk_norms(p, g))

    return blocks.sandwich_manifest(arch, mtp_layers, attention, NORMS)


# ------------------------------------------------------------------ the model
def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, rope) -> Attention:
    """Full attention with q/k norms over the whole projection (``Attention(qk_norm_full=True)``)."""
    g = Geometry.full(arch)
    aw = blocks.attention_weights(cmf, p, arch, qk_norm=False)
    aw = replace(
        aw,
        q_norm=load_vector(cmf, f"{p}self_attn.q_norm.weight", g.num_heads * g.head_dim),
        k_norm=load_vector(cmf, f"{p}self_attn.k_norm.weight", g.num_kv_heads * g.head_dim),
    )
    return blocks.make_attention(kernels, aw, g, arch, rope, qk_norm_full=True)


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if arch.sliding_window:
        raise CortiqError(f"{cmf.path}: olmo2 has full attention in every layer, the header asks for a window")
    for i in range(arch.num_layers):
        blocks.refuse_mlp_bias(cmf, f"model.layers.{i}.")
    rope = blocks.rope(arch)
    return blocks.sandwich_model(cmf, arch, kernels, lambda p, kind: attention(cmf, arch, kernels, p, rope), NORMS)


# ------------------------------------------------------------------ GGUF
def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """OLMo 2's config.json: the common fields are all it has. llama.cpp also files
    OLMo 3 (sliding-window layers) under olmo2; such a file is refused."""
    base.gguf_heads(ctx, config)
    if ctx.key("attention.sliding_window") is not None:
        raise CortiqError("olmo2 GGUFs with olmo2.attention.sliding_window (OLMo 3) are not supported")
    base.gguf_attention_bias(ctx)


GGUF = GgufSpec(
    "olmo2",
    "olmo2",
    "Olmo2ForCausalLM",
    # Gemma's four-norm block without its pre-norms: llama.cpp names the two post-sublayer
    # norms alike (q/k norms keep the shared attn_q_norm / attn_k_norm).
    block_names=SANDWICH_BLOCK_NAMES,
    config=_gguf_config,
)


PARSERS = {"olmo2": _olmo2}
# Its full-width q/k norms are implied by the arch: qk_norm, the per-head kind, is refused.
KINDS = (LAYER_FULL,)
