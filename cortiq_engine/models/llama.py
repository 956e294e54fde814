"""The Llama family: Llama (SmolLM2 included), Mistral, Qwen2 (q/k/v biases) and
Qwen3 (per-head q/k RMS norm). One pre-norm block per layer over the shared pieces;
what differs between the members is read from ``ArchConfig`` and from which
tensors the file holds (biases, q/k norms).

Draft layers (``draft_layer``) are the same block, full attention, over an MLP as wide
as its tensors; they may carry MiMo-style learned sinks (any family's drafts can sit
on a Llama trunk: DeepSeek-, MiMo- and Qwen3-Next-named ones all convert here).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import Manifest
from cortiq_engine.layers import Attention, AttentionWeights, Block, GatedMLP, RMSNorm, RoPE
from cortiq_engine.model import Model
from cortiq_engine.models import base
from cortiq_engine.models.base import DraftLayer, Family, Geometry, dense_common, draft_prefix, sliding_layers, wrap_draft
from cortiq_engine.weights import load_vector, load_weight


# ------------------------------------------------------------------ config.json
def _llama(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "llama")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    return ArchConfig(**d)


def _mistral(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "mistral")
    d["layer_types"], d["sliding_window"] = sliding_layers({**cfg, "max_window_layers": None}, d["num_layers"])
    return ArchConfig(**d)


def _qwen2(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "qwen2")
    d["attention_bias"] = True
    d["layer_types"], d["sliding_window"] = sliding_layers(cfg, d["num_layers"])
    return ArchConfig(**d)


def qwen3(cfg: dict[str, Any], arch: str = "qwen3") -> ArchConfig:
    """Qwen3 (and, with ``arch``, the attention side of Qwen3-MoE)."""
    d = dense_common(cfg, arch)
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = True
    d["layer_types"], d["sliding_window"] = sliding_layers(cfg, d["num_layers"])
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def draft_manifest(arch: ArchConfig, k: int, ffn: Manifest | None = None) -> Manifest:
    """A pre-norm draft block: full attention (sinks and q/k norms when present) and
    ``ffn`` (default: a dense MLP of any width)."""
    p, h = draft_prefix(k), arch.hidden_size
    m = base.draft_ends(arch, p).update(base.norms(p, h, "input_layernorm", "post_attention_layernorm"))
    m.update(base.attention(p, h, Geometry.full(arch), sinks=None, qk_norm=True if arch.qk_norm else None))
    return m.update(ffn if ffn is not None else base.gated_mlp(p + "mlp.", h, None))


def trunk_manifest(arch: ArchConfig) -> Manifest:
    """Pre-norm blocks of full attention over each layer's FFN (dense, or routed experts)."""
    h, m = arch.hidden_size, base.trunk_ends(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        m.update(base.norms(p, h, "input_layernorm", "post_attention_layernorm"))
        m.update(base.attention(p, h, Geometry.full(arch), qk_norm=arch.qk_norm))
        m.update(base.ffn(arch, p, i))
    return m


def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    m = trunk_manifest(arch)
    for k in mtp_layers:
        m.update(draft_manifest(arch, k))
    return m


# ------------------------------------------------------------------ the trunk


def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    if arch.moe is not None:
        raise CortiqError(f"{cmf.path}: mixture-of-experts layers are not supported by the engine yet")
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad:
        raise CortiqError(f"{cmf.path}: layer types {bad} are not supported by the engine yet")
    if arch.attn_output_gate or arch.attention_sinks or arch.sliding is not None:
        raise CortiqError(f"{cmf.path}: gated/sink/split-geometry attention is not supported by the engine yet")


def attention_weights(cmf: CmfFile, p: str, arch: ArchConfig, qk_norm: bool | None = None) -> AttentionWeights:
    """The attention tensors under prefix ``p``; biases when the file has them, q/k norms
    when ``qk_norm`` (default: ``arch.qk_norm``)."""
    q, k, v, o = (load_weight(cmf, f"{p}self_attn.{x}_proj.weight") for x in "qkvo")
    biases = [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    qkv_bias = None
    if any(b in cmf for b in biases):
        qkv_bias = np.concatenate(
            [load_vector(cmf, b, w.rows) if b in cmf else np.zeros(w.rows, np.float32) for b, w in zip(biases, (q, k, v))]
        )
    o_bias = load_vector(cmf, f"{p}self_attn.o_proj.bias", o.rows) if f"{p}self_attn.o_proj.bias" in cmf else None
    q_norm = k_norm = None
    if arch.qk_norm if qk_norm is None else qk_norm:
        q_norm = load_vector(cmf, f"{p}self_attn.q_norm.weight", arch.head_dim)
        k_norm = load_vector(cmf, f"{p}self_attn.k_norm.weight", arch.head_dim)
        if arch.norm_style == "rms_one":
            q_norm, k_norm = q_norm + 1.0, k_norm + 1.0
    return AttentionWeights(q, k, v, o, qkv_bias, o_bias, q_norm, k_norm)


def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, kind: str, rope: RoPE) -> Attention:
    """The attention of the block with prefix ``p``, every option read from ``arch``:
    ``kind`` picks the full or the sliding-window geometry (MiMo-V2's sliding layers
    have their own heads, widths and sinks in ``arch.sliding``)."""
    s = arch.sliding if kind == LAYER_SLIDING else None
    if s is not None:
        nh, nkv, hd, vd, window, has_sinks = s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim, s.window, s.sinks
    else:
        nh, nkv, hd, vd = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.v_head_dim
        window = arch.sliding_window if kind == LAYER_SLIDING else 0
        has_sinks = arch.attention_sinks
    return Attention(
        kernels,
        attention_weights(cmf, p, arch),
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        v_head_dim=vd,
        rope=rope,
        norm_eps=arch.norm_eps,
        window=window,
        scale=arch.query_pre_attn_scalar**-0.5 if arch.query_pre_attn_scalar else None,  # Gemma 3
        sinks=load_vector(cmf, f"{p}self_attn.sinks", nh) if has_sinks else None,
        v_scale=arch.attention_value_scale,
        output_gate=arch.attn_output_gate,
    )


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    _check(cmf, arch)
    h = arch.hidden_size
    rope = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    blocks = []
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        for x in ("gate", "up", "down"):
            if f"{p}mlp.{x}_proj.bias" in cmf:
                raise CortiqError(f"{cmf.path}: MLP biases are not supported by the engine yet")
        attn = attention(cmf, arch, kernels, p, kind, rope)
        mlp = GatedMLP(kernels, *(load_weight(cmf, f"{p}mlp.{x}_proj.weight") for x in ("gate", "up", "down")))
        blocks.append(
            Block(
                RMSNorm(kernels, load_vector(cmf, f"{p}input_layernorm.weight", h), arch.norm_eps, arch.norm_style),
                attn,
                RMSNorm(kernels, load_vector(cmf, f"{p}post_attention_layernorm.weight", h), arch.norm_eps, arch.norm_style),
                mlp,
            )
        )
    embed = load_weight(cmf, "model.embed_tokens.weight")
    head = embed if (arch.tie_word_embeddings or "lm_head.weight" not in cmf) else load_weight(cmf, "lm_head.weight")
    norm = RMSNorm(kernels, load_vector(cmf, "model.norm.weight", h), arch.norm_eps, arch.norm_style)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(blocks), norm=norm, head=head)


# ------------------------------------------------------------------ draft layers
def draft_attention(cmf: CmfFile, p: str, arch: ArchConfig, kernels) -> Attention:
    """A draft block's attention: the trunk's full geometry; learned sinks and q/k norms
    when the draft layer has them."""
    aw = attention_weights(cmf, p, arch, qk_norm=f"{p}self_attn.q_norm.weight" in cmf)
    sinks = base.load_sinks(cmf, f"{p}self_attn.sinks", arch.num_heads) if f"{p}self_attn.sinks" in cmf else None
    return Attention(
        kernels, aw, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
        v_head_dim=arch.v_head_dim, rope=RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling),
        norm_eps=arch.norm_eps, sinks=sinks, v_scale=arch.attention_value_scale if sinks is not None else 1.0,
    )


def draft_block(cmf: CmfFile, p: str, arch: ArchConfig, kernels, attn, mlp) -> Block:
    eps, style = arch.norm_eps, arch.norm_style
    return Block(
        RMSNorm(kernels, load_vector(cmf, f"{p}input_layernorm.weight", arch.hidden_size), eps, style),
        attn,
        RMSNorm(kernels, load_vector(cmf, f"{p}post_attention_layernorm.weight", arch.hidden_size), eps, style),
        mlp,
    )


def gated_mlp(cmf: CmfFile, kernels, p: str) -> GatedMLP:
    """The SwiGLU MLP whose tensors are ``{p}{gate,up,down}_proj.weight`` (any width)."""
    return GatedMLP(kernels, *(load_weight(cmf, f"{p}{x}_proj.weight") for x in ("gate", "up", "down")))


def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    p = draft_prefix(k)
    block = draft_block(cmf, p, arch, kernels, draft_attention(cmf, p, arch, kernels), gated_mlp(cmf, kernels, p + "mlp."))
    return wrap_draft(cmf, k, arch, kernels, block)


FAMILY = Family(
    name="llama",
    parsers={"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": qwen3},
    archs=("llama", "mistral", "qwen2", "qwen3"),
    manifest=manifest,
    build=build,
    draft_layer=draft_layer,
)
