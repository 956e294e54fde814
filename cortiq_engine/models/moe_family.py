"""Mixture-of-experts Llama-family models: Qwen2-MoE (q/k/v biases, gated shared
expert), Qwen3-MoE (q/k norm, ``norm_topk_prob``) and Mixtral (sliding window on
some releases). Attention is the Llama family's; the FFN of the layers listed in
``arch.moe.moe_layers`` is an ``MoE`` block, the others a dense ``GatedMLP``.
"""

from __future__ import annotations

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.layers import Attention, Block, GatedMLP, RMSNorm, RoPE
from cortiq_engine.model import Model
from cortiq_engine.models.llama import attention_weights
from cortiq_engine.moe import MoE, MoeBlock
from cortiq_engine.weights import load_vector, load_weight


def gated_mlp(cmf: CmfFile, kernels, p: str) -> GatedMLP:
    """The SwiGLU MLP whose tensors are ``{p}{gate,up,down}_proj.weight``."""
    return GatedMLP(kernels, *(load_weight(cmf, f"{p}{x}_proj.weight") for x in ("gate", "up", "down")))


def load_moe(cmf: CmfFile, arch: ArchConfig, kernels, p: str) -> MoE:
    """The routed-experts FFN of the layer whose prefix is ``p`` (``model.layers.{i}.``)."""
    m = arch.moe
    if m.scoring not in ("softmax", "sigmoid"):
        raise CortiqError(f"{cmf.path}: MoE scoring {m.scoring!r} is not supported (supported: softmax, sigmoid)")
    experts = [gated_mlp(cmf, kernels, f"{p}mlp.experts.{e}.") for e in range(m.num_experts)]
    shared = gated_mlp(cmf, kernels, f"{p}mlp.shared_expert.") if m.shared_expert_intermediate_size else None
    shared_gate = load_weight(cmf, f"{p}mlp.shared_expert_gate.weight") if m.shared_expert_gate else None
    bias = load_vector(cmf, f"{p}mlp.gate.e_score_correction_bias", m.num_experts) if m.score_bias else None
    return MoE(
        kernels, m, load_weight(cmf, f"{p}mlp.gate.weight"), experts,
        score_bias=bias, shared=shared, shared_gate=shared_gate,
    )


def ffn_block(cmf: CmfFile, arch: ArchConfig, kernels, i: int, attn) -> Block:
    """Layer ``i``'s residual block around ``attn``: an ``MoeBlock`` on MoE layers."""
    p, h = f"model.layers.{i}.", arch.hidden_size
    n1 = RMSNorm(kernels, load_vector(cmf, f"{p}input_layernorm.weight", h), arch.norm_eps, arch.norm_style)
    n2 = RMSNorm(kernels, load_vector(cmf, f"{p}post_attention_layernorm.weight", h), arch.norm_eps, arch.norm_style)
    if arch.moe is not None and i in arch.moe.moe_layers:
        return MoeBlock(n1, attn, n2, load_moe(cmf, arch, kernels, p), i)
    return Block(n1, attn, n2, gated_mlp(cmf, kernels, f"{p}mlp."))


def head_and_norm(cmf: CmfFile, arch: ArchConfig, kernels):
    """(embedding, lm_head, final norm) as every family stores them."""
    embed = load_weight(cmf, "model.embed_tokens.weight")
    head = embed if (arch.tie_word_embeddings or "lm_head.weight" not in cmf) else load_weight(cmf, "lm_head.weight")
    norm = RMSNorm(kernels, load_vector(cmf, "model.norm.weight", arch.hidden_size), arch.norm_eps, arch.norm_style)
    return embed, head, norm


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad or arch.attn_output_gate or arch.sliding is not None or arch.attention_sinks:
        raise CortiqError(f"{cmf.path}: {arch.arch} with layer types {bad} or gated/sink attention is not supported")
    rope = RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    blocks = []
    for i, kind in enumerate(arch.layer_types):
        attn = Attention(
            kernels,
            attention_weights(cmf, f"model.layers.{i}.", arch),
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            v_head_dim=arch.v_head_dim,
            rope=rope,
            norm_eps=arch.norm_eps,
            window=arch.sliding_window if kind == LAYER_SLIDING else 0,
        )
        blocks.append(ffn_block(cmf, arch, kernels, i, attn))
    embed, head, norm = head_and_norm(cmf, arch, kernels)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(blocks), norm=norm, head=head)
