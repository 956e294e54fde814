"""Loaders every family file builds its layers from (the part of a model file that is
the same across families): attention from ``ArchConfig``, gated MLPs, routed experts,
the pre-norm residual block, the trunk's ends and the pre-norm draft layer.

A family file imports this module and ``base``; it never imports another family file.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from formats.arch import LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import Manifest
from cortiq_engine.layers import Attention, AttentionWeights, Block, GatedMLP, RMSNorm, RoPE
from cortiq_engine.model import Model
from cortiq_engine.models import base
from cortiq_engine.models.base import DraftLayer, Geometry, draft_prefix, wrap_draft
from cortiq_engine.moe import BiasedExpert, MoE, MoeBlock
from cortiq_engine.weights import Weight, load_vector, load_weight


# ------------------------------------------------------------------ manifests of the pre-norm block
def draft_manifest(arch: ArchConfig, k: int, ffn: Manifest | None = None) -> Manifest:
    """A pre-norm draft block: full attention (sinks and q/k norms when present) and
    ``ffn`` (default: a dense MLP of any width)."""
    p, h = draft_prefix(k), arch.hidden_size
    m = base.draft_ends(arch, p).update(base.norms(p, h, "input_layernorm", "post_attention_layernorm"))
    m.update(base.attention(p, h, Geometry.full(arch), sinks=None, qk_norm=True if arch.qk_norm else None))
    return m.update(ffn if ffn is not None else base.gated_mlp(p + "mlp.", h, None))


def prenorm_manifest(arch: ArchConfig) -> Manifest:
    """Pre-norm blocks of full attention over each layer's FFN (dense, or routed experts)."""
    h, m = arch.hidden_size, base.trunk_ends(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        m.update(base.norms(p, h, "input_layernorm", "post_attention_layernorm"))
        m.update(base.attention(p, h, Geometry.full(arch), qk_norm=arch.qk_norm))
        m.update(base.ffn(arch, p, i))
    return m


def draft_manifests(arch: ArchConfig, mtp_layers: Sequence[int], routed: bool = False) -> Manifest:
    """Pre-norm draft blocks ``mtp_layers``; ``routed``: their FFN routes to experts like the trunk's."""
    m = Manifest()
    for k in mtp_layers:
        m.update(draft_manifest(arch, k, base.moe(arch, draft_prefix(k)) if routed and arch.moe is not None else None))
    return m


# ------------------------------------------------------------------ attention
def attention_weights(cmf: CmfFile, p: str, arch: ArchConfig, qk_norm: bool | None = None) -> AttentionWeights:
    """The attention tensors under prefix ``p``; biases when the file has them, q/k norms
    when ``qk_norm`` (default: ``arch.qk_norm``)."""
    q, k, v, o = (load_weight(cmf, f"{p}self_attn.{x}_proj.weight") for x in "qkvo")
    biases = [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    qkv_bias = None
    if any(b in cmf for b in biases):
        qkv_bias = np.concatenate(
            [
                load_vector(cmf, b, w.rows) if b in cmf else np.zeros(w.rows, np.float32)
                for b, w in zip(biases, (q, k, v))
            ]
        )
    o_bias = load_vector(cmf, f"{p}self_attn.o_proj.bias", o.rows) if f"{p}self_attn.o_proj.bias" in cmf else None
    q_norm = k_norm = None
    if arch.qk_norm if qk_norm is None else qk_norm:
        q_norm = load_vector(cmf, f"{p}self_attn.q_norm.weight", arch.head_dim)
        k_norm = load_vector(cmf, f"{p}self_attn.k_norm.weight", arch.head_dim)
        if arch.norm_style == "rms_one":
            q_norm, k_norm = q_norm + 1.0, k_norm + 1.0
    return AttentionWeights(q, k, v, o, qkv_bias, o_bias, q_norm, k_norm)


def rope(arch: ArchConfig) -> RoPE:
    """The full layers' rotary embedding as ``arch`` configures it (scaling included)."""
    return RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings)


def score_scale(arch: ArchConfig) -> float | None:
    """The attention score scale ``arch`` asks for (None: head_dim**-0.5)."""
    if arch.attention_scale:
        return arch.attention_scale
    if arch.query_pre_attn_scalar:
        return arch.query_pre_attn_scalar**-0.5
    return None


def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, kind: str, rope: RoPE | None) -> Attention:
    """The attention of the block with prefix ``p``, every option read from ``arch``:
    ``kind`` picks the full or the sliding-window geometry (MiMo-V2's sliding layers
    have their own heads, widths and sinks in ``arch.sliding``); ``rope`` None: no
    rotary embedding on this layer."""
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
        scale=score_scale(arch),
        sinks=load_vector(cmf, f"{p}self_attn.sinks", nh) if has_sinks else None,
        v_scale=arch.attention_value_scale,
        output_gate=arch.attn_output_gate,
        softcap=arch.attn_logit_softcapping,
    )


# ------------------------------------------------------------------ feed-forward
def gated_mlp(cmf: CmfFile, kernels, p: str) -> GatedMLP:
    """The SwiGLU MLP whose tensors are ``{p}{gate,up,down}_proj.weight`` (any width)."""
    return GatedMLP(kernels, *(load_weight(cmf, f"{p}{x}_proj.weight") for x in ("gate", "up", "down")))


def load_moe(cmf: CmfFile, arch: ArchConfig, kernels, p: str) -> MoE:
    """The routed-experts FFN of the layer whose prefix is ``p`` (``model.layers.{i}.``)."""
    m = arch.moe
    if m.scoring not in ("softmax", "sigmoid"):
        raise CortiqError(f"{cmf.path}: MoE scoring {m.scoring!r} is not supported (supported: softmax, sigmoid)")
    if m.expert_bias or m.swiglu_alpha or m.swiglu_limit:
        experts = [biased_expert(cmf, arch, kernels, f"{p}mlp.experts.{e}.") for e in range(m.num_experts)]
    else:
        experts = [gated_mlp(cmf, kernels, f"{p}mlp.experts.{e}.") for e in range(m.num_experts)]
    shared = gated_mlp(cmf, kernels, f"{p}mlp.shared_expert.") if m.shared_expert_intermediate_size else None
    shared_gate = load_weight(cmf, f"{p}mlp.shared_expert_gate.weight") if m.shared_expert_gate else None
    bias = load_vector(cmf, f"{p}mlp.gate.e_score_correction_bias", m.num_experts) if m.score_bias else None
    router_bias = load_vector(cmf, f"{p}mlp.gate.bias", m.num_experts) if m.router_bias else None
    return MoE(
        kernels,
        m,
        load_weight(cmf, f"{p}mlp.gate.weight"),
        experts,
        score_bias=bias,
        shared=shared,
        shared_gate=shared_gate,
        router_bias=router_bias,
    )


def norm(cmf: CmfFile, arch: ArchConfig, kernels, name: str, width: int | None = None) -> RMSNorm:
    """The RMS norm stored as ``name`` (``arch.norm_style``, ``arch.norm_eps``)."""
    return RMSNorm(kernels, load_vector(cmf, name, width or arch.hidden_size), arch.norm_eps, arch.norm_style)


def ffn_block(cmf: CmfFile, arch: ArchConfig, kernels, i: int, attn) -> Block:
    """Layer ``i``'s pre-norm residual block around ``attn``: an ``MoeBlock`` on MoE layers."""
    p = f"model.layers.{i}."
    n1 = norm(cmf, arch, kernels, f"{p}input_layernorm.weight")
    n2 = norm(cmf, arch, kernels, f"{p}post_attention_layernorm.weight")
    if arch.moe is not None and i in arch.moe.moe_layers:
        return MoeBlock(n1, attn, n2, load_moe(cmf, arch, kernels, p), i)
    return Block(n1, attn, n2, gated_mlp(cmf, kernels, f"{p}mlp."), residual_scale=arch.residual_scale)


def prenorm_model(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    """A trunk of pre-norm blocks, every option read from ``arch``: each layer's attention
    (no RoPE on ``arch.no_rope_layers``), its FFN (dense, or routed experts on MoE layers),
    the residual scale; embeddings scaled and logits divided as ``arch`` says."""
    rope_ = rope(arch)
    nope = set(arch.no_rope_layers)
    layers = []
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        for x in ("gate", "up", "down"):
            if f"{p}mlp.{x}_proj.bias" in cmf:
                raise CortiqError(f"{cmf.path}: MLP biases are not supported by the engine yet")
        attn = attention(cmf, arch, kernels, p, kind, None if i in nope else rope_)
        layers.append(ffn_block(cmf, arch, kernels, i, attn))
    embed, head, norm_ = head_and_norm(cmf, arch, kernels)
    return Model(
        arch=arch,
        kernels=kernels,
        embed=embed,
        blocks=tuple(layers),
        norm=norm_,
        head=head,
        embed_scale=arch.embedding_scale,
        logit_divisor=arch.logits_scaling,
    )


def head_and_norm(cmf: CmfFile, arch: ArchConfig, kernels) -> tuple[Weight, Weight, RMSNorm]:
    """(embedding, lm_head, final norm) as every family stores them."""
    embed = load_weight(cmf, "model.embed_tokens.weight")
    head = embed if (arch.tie_word_embeddings or "lm_head.weight" not in cmf) else load_weight(cmf, "lm_head.weight")
    return embed, head, norm(cmf, arch, kernels, "model.norm.weight")


# ------------------------------------------------------------------ draft layers
def draft_attention(cmf: CmfFile, p: str, arch: ArchConfig, kernels) -> Attention:
    """A draft block's attention: the trunk's full geometry; learned sinks and q/k norms
    when the draft layer has them."""
    aw = attention_weights(cmf, p, arch, qk_norm=f"{p}self_attn.q_norm.weight" in cmf)
    sinks = base.load_sinks(cmf, f"{p}self_attn.sinks", arch.num_heads) if f"{p}self_attn.sinks" in cmf else None
    return Attention(
        kernels,
        aw,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        v_head_dim=arch.v_head_dim,
        rope=rope(arch),
        norm_eps=arch.norm_eps,
        sinks=sinks,
        v_scale=arch.attention_value_scale if sinks is not None else 1.0,
    )


def draft_block(cmf: CmfFile, p: str, arch: ArchConfig, kernels, attn, mlp) -> Block:
    return Block(
        norm(cmf, arch, kernels, f"{p}input_layernorm.weight"),
        attn,
        norm(cmf, arch, kernels, f"{p}post_attention_layernorm.weight"),
        mlp,
    )


def dense_draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k`` as a pre-norm block (full attention, a dense MLP of any width): what
    ``mtp-train`` trains for a family that ships no draft layers of its own."""
    p = draft_prefix(k)
    block = draft_block(
        cmf, p, arch, kernels, draft_attention(cmf, p, arch, kernels), gated_mlp(cmf, kernels, p + "mlp.")
    )
    return wrap_draft(cmf, k, arch, kernels, block)


def routed_draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k`` as a pre-norm block whose FFN routes to experts on an MoE trunk."""
    p = draft_prefix(k)
    mlp = load_moe(cmf, arch, kernels, p) if arch.moe is not None else gated_mlp(cmf, kernels, p + "mlp.")
    block = draft_block(cmf, p, arch, kernels, draft_attention(cmf, p, arch, kernels), mlp)
    return wrap_draft(cmf, k, arch, kernels, block)


def biased_expert(cmf: CmfFile, arch: ArchConfig, kernels, p: str) -> BiasedExpert:
    """The expert under prefix ``p`` with its biases (when ``arch.moe.expert_bias``) and
    the clamped SwiGLU of ``arch.moe`` (GPT-OSS)."""
    m = arch.moe
    gate, up, down = (load_weight(cmf, f"{p}{x}_proj.weight") for x in ("gate", "up", "down"))
    biases = [
        load_vector(cmf, f"{p}{x}_proj.bias", w.rows) if m.expert_bias else None
        for x, w in (("gate", gate), ("up", up), ("down", down))
    ]
    return BiasedExpert(kernels, gate, up, down, *biases, limit=m.swiglu_limit, alpha=m.swiglu_alpha)
