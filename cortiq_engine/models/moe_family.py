"""Mixture-of-experts Llama-family models: Qwen2-MoE (q/k/v biases, gated shared
expert), Qwen3-MoE (q/k norm, ``norm_topk_prob``) and Mixtral (sliding window on
some releases). Attention is the Llama family's; the FFN of the layers listed in
``arch.moe.moe_layers`` is an ``MoE`` block, the others a dense ``GatedMLP``.
Draft layers (DeepSeek-V3 style) are a Llama draft block whose FFN routes to
experts like the trunk's MoE layers.

Checkpoint names: Mixtral's ``block_sparse_moe.{gate, experts.E.w1/w3/w2}`` become
``mlp.{gate, experts.E.gate_proj/up_proj/down_proj}``; fused 3-D experts are split.
"""

from __future__ import annotations

from typing import Any, Sequence

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig, MoeConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import Manifest
from formats.sanitize import SanitizeRules
from cortiq_engine.layers import Block, RMSNorm, RoPE
from cortiq_engine.model import Model
from cortiq_engine.models import base, llama
from cortiq_engine.models.base import DraftLayer, Family, dense_common, draft_prefix, req, sliding_layers, wrap_draft
from cortiq_engine.models.llama import gated_mlp
from cortiq_engine.moe import MoE, MoeBlock
from cortiq_engine.weights import load_vector, load_weight


# ------------------------------------------------------------------ config.json
def sparse_layers(cfg: dict[str, Any], n: int) -> list[int]:
    """Qwen-MoE rule: layer i is sparse unless in mlp_only_layers, every decoder_sparse_step-th."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def qwen_moe(cfg: dict[str, Any], n: int, shared: bool) -> MoeConfig | None:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        return None
    shared_size = int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0
    return MoeConfig(
        num_experts=experts,
        top_k=int(req(cfg, "num_experts_per_tok")),
        expert_intermediate_size=int(req(cfg, "moe_intermediate_size")),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=shared_size,
        shared_expert_gate=shared_size > 0,
        moe_layers=sparse_layers(cfg, n),
    )


def _qwen2_moe(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "qwen2_moe")
    d["attention_bias"] = bool(cfg.get("qkv_bias", True))
    d["layer_types"], d["sliding_window"] = sliding_layers(cfg, d["num_layers"])
    d["moe"] = qwen_moe(cfg, d["num_layers"], shared=True)
    return ArchConfig(**d)


def _qwen3_moe(cfg: dict[str, Any]) -> ArchConfig:
    arch = llama.qwen3(cfg, "qwen3_moe")
    arch.moe = qwen_moe(cfg, arch.num_layers, shared=False)
    return arch


def _mixtral(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "mixtral")
    d["layer_types"], d["sliding_window"] = sliding_layers({**cfg, "max_window_layers": None}, d["num_layers"])
    # Mixtral's experts are as wide as its intermediate_size; it always renormalizes the top-k.
    d["moe"] = MoeConfig(
        num_experts=int(req(cfg, "num_local_experts")),
        top_k=int(req(cfg, "num_experts_per_tok")),
        expert_intermediate_size=d["intermediate_size"],
        norm_topk_prob=True,
        moe_layers=list(range(d["num_layers"])),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    m = llama.trunk_manifest(arch)
    for k in mtp_layers:
        routed = base.moe(arch, draft_prefix(k)) if arch.moe is not None else None
        m.update(llama.draft_manifest(arch, k, routed))
    return m


# ------------------------------------------------------------------ the trunk


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
        attn = llama.attention(cmf, arch, kernels, f"model.layers.{i}.", kind, rope)
        blocks.append(ffn_block(cmf, arch, kernels, i, attn))
    embed, head, norm = head_and_norm(cmf, arch, kernels)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(blocks), norm=norm, head=head)


# ------------------------------------------------------------------ draft layers
def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    p = draft_prefix(k)
    mlp = load_moe(cmf, arch, kernels, p) if arch.moe is not None else gated_mlp(cmf, kernels, p + "mlp.")
    block = llama.draft_block(cmf, p, arch, kernels, llama.draft_attention(cmf, p, arch, kernels), mlp)
    return wrap_draft(cmf, k, arch, kernels, block)


FAMILY = Family(
    name="moe",
    parsers={"qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral},
    archs=("qwen2_moe", "qwen3_moe", "mixtral"),
    manifest=manifest,
    build=build,
    draft_layer=draft_layer,
    sanitize=SanitizeRules(
        renames=(
            (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
            (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
            (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
            (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
        ),
        split_fused_experts=True,
    ),
)
