"""The Qwen3-Next hybrid family: Qwen3-Next (fused linear projections, MoE with a
gated shared expert), Qwen3.5 (split projections, dense MLP) and Qwen3.5-MoE.

Layers are Gated DeltaNet linear attention (``gated_deltanet``) or full attention
with an output gate (q_proj emits [query | gate] per head; the attention output is
multiplied by sigmoid(gate) before o_proj), per-head q/k RMS norm and partial
rotary. Every RMSNorm scales by (1 + w) except the gated norm inside the linear
layers. The one MTP layer is a full-attention block of the trunk (gated attention,
MoE with its gated shared expert on an MoE trunk).

Checkpoint names: the multimodal Qwen3.5 wrappers' ``model.language_model.*`` (every
family's rule), fused 3-D experts split, depthwise ``conv1d.weight`` [C, 1, K] -> [C, K].
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from formats.arch import LAYER_FULL, LAYER_LINEAR, ArchConfig, LinearAttnConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import Manifest
from formats.sanitize import SanitizeRules
from cortiq_engine.gated_deltanet import GatedDeltaNet, LinearAttnWeights
from cortiq_engine.layers import RoPE
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import DraftLayer, Geometry, dense_common, draft_prefix, req
from cortiq_engine.weights import load_vector, load_weight


# ------------------------------------------------------------------ config.json
def _hybrid_layer_types(cfg: dict[str, Any], n: int) -> list[str]:
    lt = cfg.get("layer_types") or base.every_nth_full(
        n, int(cfg.get("full_attention_interval") or 4), "linear_attention"
    )
    return base.layer_kinds(lt, n, ("linear_attention", "full_attention"))


def _linear_attn_config(cfg: dict[str, Any], fused: bool) -> LinearAttnConfig:
    la = LinearAttnConfig(
        num_key_heads=int(req(cfg, "linear_num_key_heads")),
        num_value_heads=int(req(cfg, "linear_num_value_heads")),
        key_head_dim=int(req(cfg, "linear_key_head_dim")),
        value_head_dim=int(req(cfg, "linear_value_head_dim")),
        conv_kernel=int(req(cfg, "linear_conv_kernel_dim")),
        fused_projection=fused,
    )
    if la.num_value_heads % la.num_key_heads:
        raise CortiqError(
            f"linear_num_value_heads={la.num_value_heads} is not a multiple of linear_num_key_heads={la.num_key_heads}"
        )
    return la


def _parse(cfg: dict[str, Any], arch: str, fused: bool, moe: bool) -> ArchConfig:
    d = dense_common(cfg, arch)
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = True
    d["attn_output_gate"] = True
    d["norm_style"] = "rms_one"
    if not d["rotary_dim"]:
        d["rotary_dim"] = int(d["head_dim"] * 0.25)  # the family's default partial_rotary_factor
    d["layer_types"] = _hybrid_layer_types(cfg, d["num_layers"])
    d["linear_attn"] = _linear_attn_config(cfg, fused)
    d["moe"] = base.qwen_moe(cfg, d["num_layers"], shared=True) if moe else None
    return ArchConfig(**d)


def _qwen3_next(cfg: dict[str, Any]) -> ArchConfig:
    return _parse(cfg, "qwen3_next", fused=True, moe=True)


def _qwen3_5(cfg: dict[str, Any]) -> ArchConfig:
    return _parse(cfg, "qwen3_5", fused=False, moe=False)


def _qwen3_5_moe(cfg: dict[str, Any]) -> ArchConfig:
    # Every layer is sparse and the top-k is always renormalized (no config keys for either).
    cfg = {**cfg, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    return _parse(cfg, "qwen3_5_moe", fused=False, moe=True)


# ------------------------------------------------------------------ manifest
def _linear_attn_manifest(arch: ArchConfig, p: str) -> Manifest:
    """A Gated DeltaNet token mixer (Qwen3-Next fused projections, Qwen3.5 split ones)."""
    la, h = arch.linear_attn, arch.hidden_size
    kd, vd = la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim
    conv = 2 * kd + vd
    q = p + "linear_attn."
    m = Manifest(
        {
            q + "conv1d.weight": (conv, la.conv_kernel),
            q + "dt_bias": (la.num_value_heads,),
            q + "A_log": (la.num_value_heads,),
            q + "norm.weight": (la.value_head_dim,),
            q + "out_proj.weight": (h, vd),
        }
    )
    if la.fused_projection:
        m.required[q + "in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
        m.required[q + "in_proj_ba.weight"] = (2 * la.num_value_heads, h)
    else:
        m.required[q + "in_proj_qkv.weight"] = (conv, h)
        m.required[q + "in_proj_z.weight"] = (vd, h)
        m.required[q + "in_proj_b.weight"] = (la.num_value_heads, h)
        m.required[q + "in_proj_a.weight"] = (la.num_value_heads, h)
    return m


def _full_attention(arch: ArchConfig, p: str) -> Manifest:
    return base.attention(p, arch.hidden_size, Geometry.full(arch), gate=arch.attn_output_gate, qk_norm=arch.qk_norm)


def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Linear or output-gated full attention per layer over its FFN; the MTP layer is a
    full-attention block that routes like the trunk's (dense on a dense trunk)."""

    def mixer(p: str, kind: str) -> Manifest:
        return _linear_attn_manifest(arch, p) if kind == LAYER_LINEAR else _full_attention(arch, p)

    trunk = blocks.prenorm_manifest(arch, mixer)
    return trunk.update(blocks.draft_manifests(arch, mtp_layers, routed=True, attention=mixer))


# ------------------------------------------------------------------ the trunk


def _linear_attn(cmf: CmfFile, arch: ArchConfig, kernels, p: str) -> GatedDeltaNet:
    la = arch.linear_attn
    q = p + "linear_attn."
    names = (
        ("in_proj_qkvz", "in_proj_ba")
        if la.fused_projection
        else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    )
    conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
    conv = cmf.tensor_f32(q + "conv1d.weight").reshape(conv_dim, la.conv_kernel)
    w = LinearAttnWeights(
        in_proj=tuple(load_weight(cmf, f"{q}{nm}.weight") for nm in names),
        conv=np.ascontiguousarray(conv, dtype=np.float32),
        A_log=load_vector(cmf, q + "A_log", la.num_value_heads),
        dt_bias=load_vector(cmf, q + "dt_bias", la.num_value_heads),
        norm=load_vector(cmf, q + "norm.weight", la.value_head_dim),
        out_proj=load_weight(cmf, q + "out_proj.weight"),
    )
    return GatedDeltaNet(kernels, la, w, arch.norm_eps)


def _rope(arch: ArchConfig) -> RoPE:
    return RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if arch.linear_attn is None:
        raise CortiqError(f"{cmf.path}: {arch.arch} header has no linear_attn geometry")
    rope = _rope(arch)

    def mixer(p: str, kind: str):
        if kind == LAYER_LINEAR:
            return _linear_attn(cmf, arch, kernels, p)
        return blocks.attention(cmf, arch, kernels, p, kind, rope)

    return blocks.prenorm_model(cmf, arch, kernels, mixer=mixer)


# ------------------------------------------------------------------ draft layers
def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """The MTP layer: the trunk's full-attention block (output gate, q/k norm, partial
    rotary) whose FFN routes to experts on an MoE trunk."""
    p = draft_prefix(k)
    attn = blocks.attention(cmf, arch, kernels, p, LAYER_FULL, _rope(arch))
    return blocks.prenorm_draft(cmf, k, arch, kernels, attn, blocks.routed_or_dense(cmf, arch, kernels, p))


PARSERS = {"qwen3_next": _qwen3_next, "qwen3_5_text": _qwen3_5, "qwen3_5_moe_text": _qwen3_5_moe}
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
KINDS = (LAYER_FULL, LAYER_LINEAR)
COMPUTES = ("linear attention", "routed experts", "q/k norms", "an attention output gate", "(1 + w) norms")
SANITIZE = SanitizeRules(split_fused_experts=True, squeeze_conv=True)
MTP_STYLE = "qwen3_next"
