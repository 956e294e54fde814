"""Loaders every family file builds its layers from (the part of a model file that is
the same across families): attention from ``ArchConfig``, gated MLPs (SwiGLU, GeGLU),
routed experts, the pre-norm trunk (``prenorm_model``: a family with latent or linear
attention passes its own token mixer) and its manifest, the sandwich trunk of Gemma 2/3
and OLMo 2 (``sandwich_model``, four norms per block) and its manifest, the trunk's ends
(``trunk``) and the pre-norm draft layer.

A family file imports this module and ``base``; it never imports another family file.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from formats.arch import ACTIVATIONS, LAYER_FULL, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import Manifest
from cortiq_engine.layers import Attention, AttentionWeights, Block, GatedMLP, RMSNorm, RoPE, SandwichBlock
from cortiq_engine.model import Model
from cortiq_engine.models import base
from cortiq_engine.models.base import DraftLayer, Geometry, draft_prefix, wrap_draft
from cortiq_engine.moe import BiasedExpert, MoE, MoeBlock
from cortiq_engine.weights import load_vector, load_weight


# ------------------------------------------------------------------ manifests of the pre-norm block
AttentionManifest = Callable[[str, str], Manifest]  # (prefix, layer kind) -> the attention's tensors


def block_manifest(arch: ArchConfig, p: str, attn: Manifest, ffn: Manifest) -> Manifest:
    """A pre-norm block under prefix ``p``: its two norms, ``attn`` and ``ffn``."""
    return base.norms(p, arch.hidden_size, "input_layernorm", "post_attention_layernorm").update(attn).update(ffn)


def draft_manifest(
    arch: ArchConfig,
    k: int,
    ffn: Manifest | None = None,
    attention: AttentionManifest | None = None,
    kind: str = LAYER_FULL,
) -> Manifest:
    """A pre-norm draft block: ``attention`` of a ``kind`` layer (default: full attention,
    sinks and q/k norms when present) and ``ffn`` (default: a dense MLP of any width)."""
    p, h = draft_prefix(k), arch.hidden_size
    if attention is not None:
        attn = attention(p, kind)
    else:
        attn = base.attention(p, h, Geometry.full(arch), sinks=None, qk_norm=True if arch.qk_norm else None)
    return base.draft_ends(arch, p).update(
        block_manifest(arch, p, attn, ffn if ffn is not None else base.gated_mlp(p + "mlp.", h, None))
    )


def prenorm_manifest(arch: ArchConfig, attention: AttentionManifest | None = None) -> Manifest:
    """Pre-norm blocks over each layer's FFN (dense, or routed experts); ``attention``:
    a layer's attention tensors (default: full attention, q/k norms by ``arch.qk_norm``)."""
    m = base.trunk_ends(arch)
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        if attention is not None:
            attn = attention(p, kind)
        else:
            attn = base.attention(p, arch.hidden_size, Geometry.full(arch), qk_norm=arch.qk_norm)
        m.update(block_manifest(arch, p, attn, base.ffn(arch, p, i)))
    return m


def draft_manifests(
    arch: ArchConfig,
    mtp_layers: Sequence[int],
    routed: bool = False,
    attention: AttentionManifest | None = None,
    kind: str = LAYER_FULL,
) -> Manifest:
    """Pre-norm draft blocks ``mtp_layers``; ``routed``: their FFN routes to experts like
    the trunk's (on an MoE trunk); ``attention`` and ``kind`` as for ``draft_manifest``."""
    m = Manifest()
    for k in mtp_layers:
        ffn = base.moe(arch, draft_prefix(k)) if routed and arch.moe is not None else None
        m.update(draft_manifest(arch, k, ffn, attention, kind))
    return m


def dense_manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """A pre-norm trunk (attention biases read when present) and its pre-norm draft blocks."""
    return prenorm_manifest(arch).update(draft_manifests(arch, mtp_layers))


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


def make_attention(
    kernels, aw: AttentionWeights, g: Geometry, arch: ArchConfig, rope: RoPE | None, **options
) -> Attention:
    """An ``Attention`` of head layout ``g`` over ``aw`` (``arch``'s norm epsilon);
    ``options``: the rest of ``Attention``'s (window, scale, sinks, ...)."""
    return Attention(kernels, aw, rope=rope, norm_eps=arch.norm_eps, **g.heads(), **options)


def attention(cmf: CmfFile, arch: ArchConfig, kernels, p: str, kind: str, rope: RoPE | None) -> Attention:
    """The attention of the block with prefix ``p``, every option read from ``arch``:
    ``kind`` picks the layer's geometry (``Geometry.of``: MiMo-V2's sliding layers have
    their own heads, widths and sinks); ``rope`` None: no rotary embedding on this layer."""
    g = Geometry.of(arch, kind)
    return make_attention(
        kernels,
        attention_weights(cmf, p, arch),
        g,
        arch,
        rope,
        window=g.window,
        scale=score_scale(arch),
        sinks=load_vector(cmf, f"{p}self_attn.sinks", g.num_heads) if g.sinks else None,
        v_scale=arch.attention_value_scale,
        output_gate=arch.attn_output_gate,
        softcap=arch.attn_logit_softcapping,
    )


# ------------------------------------------------------------------ feed-forward
def gated_mlp(cmf: CmfFile, kernels, p: str, act: str = "silu") -> GatedMLP:
    """The gated MLP whose tensors are ``{p}{gate,up,down}_proj.weight`` (any width);
    ``act``: the config's activation name (SwiGLU by default, GeGLU for Gemma's)."""
    return GatedMLP(kernels, *(load_weight(cmf, f"{p}{x}_proj.weight") for x in ("gate", "up", "down")), act)


def refuse_mlp_bias(cmf: CmfFile, p: str) -> None:
    """The dense MLP under ``p`` has no biases in any family the engine computes."""
    for x in ("gate", "up", "down"):
        if f"{p}mlp.{x}_proj.bias" in cmf:
            raise CortiqError(f"{cmf.path}: MLP biases are not supported by the engine yet")


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


def routed_or_dense(cmf: CmfFile, arch: ArchConfig, kernels, p: str):
    """The FFN under ``p``: routed experts on an MoE trunk, else a dense MLP of any width."""
    return load_moe(cmf, arch, kernels, p) if arch.moe is not None else gated_mlp(cmf, kernels, p + "mlp.")


# ------------------------------------------------------------------ the trunk
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


# What ``prenorm_model`` computes beyond full or sliding attention over plain norms
# (``base.SETTINGS``); each family refuses what its own checkpoints never have.
PRENORM = (
    "q/k norms",
    "(1 + w) norms",
    "NoPE layers",
    "Granite's multipliers",
    "query_pre_attn_scalar",
    "an attention soft-cap",
)


def prenorm_model(
    cmf: CmfFile,
    arch: ArchConfig,
    kernels,
    ropes: Mapping[str, RoPE] | None = None,
    mixer: Callable[[str, str], Any] | None = None,
) -> Model:
    """A trunk of pre-norm blocks, every option read from ``arch``: each layer's token
    mixer, its FFN (dense, or routed experts on MoE layers), the residual scale. The
    mixer is ``attention`` with the RoPE of the layer's kind (``ropes``; default
    ``rope(arch)`` for every kind; none on ``arch.no_rope_layers``), or the family's own
    ``mixer(prefix, kind)`` (latent or linear attention)."""
    default = rope(arch) if ropes is None else None  # one table cache for every kind
    nope = set(arch.no_rope_layers)
    layers = []
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        refuse_mlp_bias(cmf, p)
        if mixer is not None:
            m = mixer(p, kind)
        else:
            r = None if i in nope else (default if ropes is None else ropes[kind])
            m = attention(cmf, arch, kernels, p, kind, r)
        layers.append(ffn_block(cmf, arch, kernels, i, m))
    return trunk(cmf, arch, kernels, layers)


def trunk(cmf: CmfFile, arch: ArchConfig, kernels, layers: Sequence[Any], **options) -> Model:
    """The ``Model`` of ``layers`` between the embedding and the final norm and lm_head,
    as every family stores them; embeddings scaled and logits divided as ``arch`` says
    (``options``: the rest of ``Model``'s, or an ``embed_scale`` of the family's own)."""
    embed = load_weight(cmf, "model.embed_tokens.weight")
    head = embed if (arch.tie_word_embeddings or "lm_head.weight" not in cmf) else load_weight(cmf, "lm_head.weight")
    options = {"embed_scale": arch.embedding_scale, "logit_divisor": arch.logits_scaling, **options}
    return Model(
        arch=arch,
        kernels=kernels,
        embed=embed,
        blocks=tuple(layers),
        norm=norm(cmf, arch, kernels, "model.norm.weight"),
        head=head,
        **options,
    )


# ------------------------------------------------------------------ the sandwich block
# Gemma's four norms per block (before and after attention, before and after the MLP).
SANDWICH_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# Gemma's GeGLU: the tanh-approximated GELU, besides SwiGLU.
GELU_TANH = "gelu_pytorch_tanh"
GEGLU_ACTIVATIONS = ACTIVATIONS + (GELU_TANH,)


def sandwich_manifest(
    arch: ArchConfig,
    mtp_layers: Sequence[int],
    attention: Callable[[str], Manifest],
    norms: Sequence[str | None] = SANDWICH_NORMS,
) -> Manifest:
    """Per layer under prefix ``p``: the ``norms`` (as for ``sandwich_model``),
    ``attention(p)``'s tensors and the dense gated MLP; draft layers (none ship with these
    families; mtp-train can make them) are pre-norm draft blocks."""
    h, m = arch.hidden_size, base.trunk_ends(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        m.update(base.norms(p, h, *(n for n in norms if n is not None))).update(attention(p))
        m.update(base.gated_mlp(p + "mlp.", h, arch.intermediate_size))
    return m.update(draft_manifests(arch, mtp_layers))


def sandwich_model(
    cmf: CmfFile,
    arch: ArchConfig,
    kernels,
    mixer: Callable[[str, str], Any],
    norms: Sequence[str | None] = SANDWICH_NORMS,
    **options,
) -> Model:
    """A trunk of ``SandwichBlock``s: each layer's ``mixer(prefix, kind)``, its four norms
    (``norms``; None: that sublayer reads the residual stream itself) and a dense gated
    MLP of ``arch.hidden_act``; ``options``: ``trunk``'s."""
    layers = []
    for i, kind in enumerate(arch.layer_types):
        p = f"model.layers.{i}."
        ns = tuple(None if n is None else norm(cmf, arch, kernels, f"{p}{n}.weight") for n in norms)
        layers.append(SandwichBlock(ns, mixer(p, kind), gated_mlp(cmf, kernels, f"{p}mlp.", arch.hidden_act)))
    return trunk(cmf, arch, kernels, layers, **options)


def gemma_trunk_options(arch: ArchConfig) -> dict[str, float]:
    """Gemma's embeddings times sqrt(hidden), cast to the weights' dtype (f32) as
    transformers does, and its final soft-cap (0: none)."""
    return {"embed_scale": float(np.float32(arch.hidden_size**0.5)), "logit_softcap": arch.final_logit_softcapping}


# ------------------------------------------------------------------ draft layers
def draft_attention(cmf: CmfFile, p: str, arch: ArchConfig, kernels) -> Attention:
    """A draft block's attention: the trunk's full geometry; learned sinks and q/k norms
    when the draft layer has them."""
    aw = attention_weights(cmf, p, arch, qk_norm=f"{p}self_attn.q_norm.weight" in cmf)
    sinks = base.load_sinks(cmf, f"{p}self_attn.sinks", arch.num_heads) if f"{p}self_attn.sinks" in cmf else None
    return make_attention(
        kernels,
        aw,
        Geometry.full(arch),
        arch,
        rope(arch),
        sinks=sinks,
        v_scale=arch.attention_value_scale if sinks is not None else 1.0,
    )


def prenorm_draft(cmf: CmfFile, k: int, arch: ArchConfig, kernels, attn, mlp) -> DraftLayer:
    """MTP layer ``k``: a pre-norm block of ``attn`` and ``mlp`` between the shared draft ends."""
    p = draft_prefix(k)
    block = Block(
        norm(cmf, arch, kernels, f"{p}input_layernorm.weight"),
        attn,
        norm(cmf, arch, kernels, f"{p}post_attention_layernorm.weight"),
        mlp,
    )
    return wrap_draft(cmf, k, arch, kernels, block)


def dense_draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k`` as a pre-norm block (full attention, a dense MLP of any width): what
    ``mtp-train`` trains for a family that ships no draft layers of its own."""
    p = draft_prefix(k)
    return prenorm_draft(
        cmf, k, arch, kernels, draft_attention(cmf, p, arch, kernels), gated_mlp(cmf, kernels, p + "mlp.")
    )


def routed_draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k`` as a pre-norm block whose FFN routes to experts on an MoE trunk."""
    p = draft_prefix(k)
    return prenorm_draft(
        cmf, k, arch, kernels, draft_attention(cmf, p, arch, kernels), routed_or_dense(cmf, arch, kernels, p)
    )
