"""The Llama family: Llama (SmolLM2 included), Mistral, Qwen2 (q/k/v biases) and
Qwen3 (per-head q/k RMS norm). One pre-norm block per layer over the shared pieces;
what differs between the members is read from ``ArchConfig`` and from which
tensors the file holds (biases, q/k norms).
"""

from __future__ import annotations

import numpy as np

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.layers import Attention, AttentionWeights, Block, GatedMLP, RMSNorm, RoPE
from cortiq_engine.model import Model
from cortiq_engine.weights import load_vector, load_weight


def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    if arch.moe is not None:
        raise CortiqError(f"{cmf.path}: mixture-of-experts layers are not supported by the engine yet")
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad:
        raise CortiqError(f"{cmf.path}: layer types {bad} are not supported by the engine yet")
    if arch.attn_output_gate or arch.attention_sinks or arch.sliding is not None:
        raise CortiqError(f"{cmf.path}: gated/sink/split-geometry attention is not supported by the engine yet")


def attention_weights(cmf: CmfFile, p: str, arch: ArchConfig) -> AttentionWeights:
    q, k, v, o = (load_weight(cmf, f"{p}self_attn.{x}_proj.weight") for x in "qkvo")
    biases = [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    qkv_bias = None
    if any(b in cmf for b in biases):
        qkv_bias = np.concatenate(
            [load_vector(cmf, b, w.rows) if b in cmf else np.zeros(w.rows, np.float32) for b, w in zip(biases, (q, k, v))]
        )
    o_bias = load_vector(cmf, f"{p}self_attn.o_proj.bias", o.rows) if f"{p}self_attn.o_proj.bias" in cmf else None
    q_norm = k_norm = None
    if arch.qk_norm:
        q_norm = load_vector(cmf, f"{p}self_attn.q_norm.weight", arch.head_dim)
        k_norm = load_vector(cmf, f"{p}self_attn.k_norm.weight", arch.head_dim)
        if arch.norm_style == "rms_one":
            q_norm, k_norm = q_norm + 1.0, k_norm + 1.0
    return AttentionWeights(q, k, v, o, qkv_bias, o_bias, q_norm, k_norm)


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
        attn = Attention(
            kernels,
            attention_weights(cmf, p, arch),
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            v_head_dim=arch.v_head_dim,
            rope=rope,
            norm_eps=arch.norm_eps,
            window=arch.sliding_window if kind == LAYER_SLIDING else 0,
        )
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
