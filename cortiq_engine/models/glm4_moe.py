"""GLM-4.5 / GLM-4.5-Air (``Glm4MoeForCausalLM``, model_type ``glm4_moe``).

Pre-norm blocks of full attention: q/k/v biases (``attention_bias``, never an o_proj
bias), optional per-head q/k RMS norms (``use_qk_norm``, before RoPE), rotary on the
first ``partial_rotary_factor`` of each head (0.5 in the releases and by default),
rotated by halves (transformers' ``rotate_half``, the engine's ``RoPE`` layout). The
first ``first_k_dense_replace`` layers have a dense MLP; the others route DeepSeek-V3
style: sigmoid scores, ``e_score_correction_bias`` for the choice, the best
``topk_group`` of ``n_group`` groups (a group scores its two best experts), weights
renormalized when ``norm_topk_prob`` and times ``routed_scaling_factor``, plus an
ungated shared expert ``n_shared_experts`` experts wide.

The release's MTP layer (``num_nextn_predict_layers``, stored DeepSeek-style as
``model.layers.{num_hidden_layers}.*``) is a trunk MoE layer between the shared draft
ends (``draft_layer``): the same attention and the routed FFN with its shared expert.

Checkpoint names: ``mlp.shared_experts.*`` -> ``mlp.shared_expert.*``.

GGUF: llama.cpp's ``glm4moe`` (``GGUF``): q/k rows as HF has them (NEOX rotary, by
halves), stacked experts split per expert, the ``nextn.*`` MTP layer counted in
``block_count`` and the routing settings in the ``expert_*`` keys.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from formats.arch import LAYER_FULL, ArchConfig, MoeConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import MOE_BLOCK_NAMES, NEXTN_BLOCK_NAMES, ROUTING_BIAS, GgufContext, GgufSpec
from formats.manifest import Manifest
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import DraftLayer, Geometry, dense_common, draft_prefix, req

ARCH = "glm4_moe"


# ------------------------------------------------------------------ config.json
def _glm4_moe(cfg: dict[str, Any]) -> ArchConfig:
    flat = dict(cfg)
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if not cfg.get("partial_rotary_factor") and not rp.get("partial_rotary_factor"):
        flat["partial_rotary_factor"] = 0.5  # transformers' default for glm4_moe
    if flat.get("rms_norm_eps") is None:
        flat["rms_norm_eps"] = 1e-5
    d = dense_common(flat, ARCH)
    n = d["num_layers"]
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = bool(cfg.get("use_qk_norm", False))
    d["layer_types"] = [LAYER_FULL] * n
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise CortiqError(f"glm4_moe scoring_func {scoring!r} is not supported (GLM-4-MoE routes by sigmoid)")
    if cfg.get("topk_method") not in (None, "noaux_tc"):
        raise CortiqError(f"glm4_moe topk_method {cfg['topk_method']!r} is not supported (supported: noaux_tc)")
    first_k = cfg.get("first_k_dense_replace")
    first_k = 1 if first_k is None else int(first_k)
    if not 0 <= first_k < n:
        raise CortiqError(f"glm4_moe first_k_dense_replace={first_k} leaves no MoE layer among {n} layers")
    experts = int(req(cfg, "n_routed_experts"))
    n_shared = cfg.get("n_shared_experts")
    n_shared = 1 if n_shared is None else int(n_shared)
    if n_shared < 0:
        raise CortiqError(f"glm4_moe n_shared_experts={n_shared} is negative")
    expert_inter = int(req(cfg, "moe_intermediate_size"))
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or 1)
    top_k = int(req(cfg, "num_experts_per_tok"))
    if n_group >= 1 and experts % n_group == 0 and top_k > topk_group * (experts // n_group):
        # transformers would then pick experts its group mask ruled out.
        raise CortiqError(
            f"glm4_moe num_experts_per_tok={top_k} exceeds the {topk_group * (experts // n_group)} experts "
            f"of topk_group={topk_group} groups"
        )
    d["moe"] = MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=expert_inter,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=expert_inter * n_shared,
        shared_expert_gate=False,
        moe_layers=list(range(first_k, n)),
        scoring="sigmoid",
        score_bias=True,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def _attention(arch: ArchConfig, p: str) -> Manifest:
    """q/k/v/o; q/k/v biases required with ``attention_bias`` (else not read), no o bias."""
    m = base.attention(p, arch.hidden_size, Geometry.full(arch), qk_norm=arch.qk_norm)
    q = p + "self_attn."
    del m.optional[q + "o_proj.bias"]
    for x in "qkv":
        shape = m.optional.pop(f"{q}{x}_proj.bias")
        if arch.attention_bias:
            m.required[f"{q}{x}_proj.bias"] = shape
    return m


def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Pre-norm blocks over each layer's FFN; the MTP layer routes like the trunk's."""

    def attention(p: str, kind: str) -> Manifest:
        return _attention(arch, p)

    trunk = blocks.prenorm_manifest(arch, attention)
    return trunk.update(blocks.draft_manifests(arch, mtp_layers, routed=True, attention=attention))


# ------------------------------------------------------------------ the trunk
def _check_attention(cmf: CmfFile, arch: ArchConfig, p: str) -> None:
    """transformers never reads an o_proj bias, nor q/k/v biases without ``attention_bias``:
    a file holding them would run as another model here."""
    extra = [f"{p}self_attn.o_proj.bias"]
    if not arch.attention_bias:
        extra += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    for name in extra:
        if name in cmf:
            raise CortiqError(f"{cmf.path}: glm4_moe has no tensor {name} (attention_bias={arch.attention_bias})")


# What a GLM-4.5 header may ask for (``base.SETTINGS``); the rest is refused.
COMPUTES = ("routed experts", "q/k norms")


def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    if arch.moe is None or arch.moe.scoring != "sigmoid" or not arch.moe.score_bias or arch.moe.shared_expert_gate:
        raise CortiqError(f"{cmf.path}: glm4_moe header without its sigmoid-routed MoE")


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    _check(cmf, arch)
    for i in range(arch.num_layers):
        _check_attention(cmf, arch, f"model.layers.{i}.")
    return blocks.prenorm_model(cmf, arch, kernels)


# ------------------------------------------------------------------ draft layers
def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k``: the trunk's attention (biases, q/k norms, partial rotary) and its
    routed FFN with the shared expert, as GLM's MTP layer is a decoder layer past the last."""
    base.refuse_header(cmf, arch, (LAYER_FULL,), COMPUTES)  # as Family.model does for the trunk
    _check(cmf, arch)
    p = draft_prefix(k)
    _check_attention(cmf, arch, p)
    attn = blocks.attention(cmf, arch, kernels, p, LAYER_FULL, blocks.rope(arch))
    return blocks.prenorm_draft(cmf, k, arch, kernels, attn, blocks.load_moe(cmf, arch, kernels, p))


# ------------------------------------------------------------------ GGUF
def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """GLM-4.5's config.json from llama.cpp's metadata. ``block_count`` counts the MTP
    layers (``nextn_predict_layers``) after the trunk's; a missing gating function is
    sigmoid and a missing ``expert_weights_norm`` false, as llama.cpp reads them."""
    base.gguf_heads(ctx, config, rotary=False)
    hd = config["head_dim"]
    rot = base.gguf_size(ctx, "rope.dimension_count", hd)
    if not 0 < rot <= hd or rot % 2 or int(hd * (rot / hd)) != rot:
        raise CortiqError(f"GGUF metadata {ctx.arch}.rope.dimension_count={rot} does not fit head size {hd}")
    blocks_total = config["num_hidden_layers"]
    nextn = base.gguf_size(ctx, "nextn_predict_layers", 0)
    if nextn >= blocks_total:
        raise CortiqError(
            f"GGUF metadata {ctx.arch}.nextn_predict_layers={nextn} leaves no trunk layer of {blocks_total}"
        )
    gating = base.gguf_size(ctx, "expert_gating_func", 2)
    if gating not in (0, 2):  # 0: unset (llama.cpp then uses sigmoid), 2: sigmoid
        raise CortiqError(
            f"GGUF metadata {ctx.arch}.expert_gating_func={gating} is not supported (GLM-4-MoE routes by sigmoid)"
        )
    if "blk.0.attn_output.bias" in ctx.tensors:
        raise CortiqError("glm4moe GGUF with an attn_output bias is not supported (GLM-4-MoE has none)")
    routed = [i for i in range(blocks_total) if f"blk.{i}.ffn_gate_inp.weight" in ctx.tensors]
    dense = base.gguf_size(ctx, "leading_dense_block_count", routed[0] if routed else 0)
    norm = ctx.key("expert_weights_norm", False)
    scale = ctx.key("expert_weights_scale", 1.0)
    if (
        not isinstance(norm, (bool, np.bool_))
        or isinstance(scale, bool)
        or not isinstance(scale, (int, float, np.number))
    ):
        raise CortiqError(
            f"GGUF metadata {ctx.arch}.expert_weights_norm / expert_weights_scale are {norm!r} / {scale!r}"
        )
    config.update(
        num_hidden_layers=blocks_total - nextn,
        num_nextn_predict_layers=nextn,
        partial_rotary_factor=rot / hd,
        attention_bias=base.gguf_attention_bias(ctx, ("q", "k", "v")),
        use_qk_norm="blk.0.attn_q_norm.weight" in ctx.tensors,
        first_k_dense_replace=dense,
        n_routed_experts=base.gguf_size(ctx, "expert_count", required=True),
        num_experts_per_tok=base.gguf_size(ctx, "expert_used_count", required=True),
        moe_intermediate_size=base.gguf_size(ctx, "expert_feed_forward_length", required=True),
        n_shared_experts=base.gguf_size(ctx, "expert_shared_count", 0),
        n_group=base.gguf_size(ctx, "expert_group_count", 1) or 1,
        topk_group=base.gguf_size(ctx, "expert_group_used_count", 1) or 1,
        norm_topk_prob=bool(norm),
        routed_scaling_factor=float(scale),
    )


GGUF = GgufSpec(
    "glm4moe",
    "glm4_moe",
    "Glm4MoeForCausalLM",
    block_names={
        "post_attention_norm": "post_attention_layernorm",
        **MOE_BLOCK_NAMES,
        **NEXTN_BLOCK_NAMES,
    },
    full_names=ROUTING_BIAS,
    config=_gguf_config,
)


PARSERS = {"glm4_moe": _glm4_moe}
KINDS = (LAYER_FULL,)
SANITIZE = base.SHARED_EXPERTS_RULES
