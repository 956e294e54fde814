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

from formats.arch import ArchConfig, MoeConfig
from formats.manifest import Manifest
from formats.sanitize import SanitizeRules
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import dense_common, req, sliding_layers


# ------------------------------------------------------------------ config.json
def _qwen2_moe(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "qwen2_moe")
    d["attention_bias"] = bool(cfg.get("qkv_bias", True))
    d["layer_types"], d["sliding_window"] = sliding_layers(cfg, d["num_layers"])
    d["moe"] = base.qwen_moe(cfg, d["num_layers"], shared=True)
    return ArchConfig(**d)


def _qwen3_moe(cfg: dict[str, Any]) -> ArchConfig:
    d = dense_common(cfg, "qwen3_moe")
    d["attention_bias"] = bool(cfg.get("attention_bias", False))
    d["qk_norm"] = True
    d["layer_types"], d["sliding_window"] = sliding_layers(cfg, d["num_layers"])
    d["moe"] = base.qwen_moe(cfg, d["num_layers"], shared=False)
    return ArchConfig(**d)


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
    return blocks.prenorm_manifest(arch).update(blocks.draft_manifests(arch, mtp_layers, routed=True))


PARSERS = {"qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral}
ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")
draft_layer = blocks.routed_draft_layer
COMPUTES = (*blocks.PRENORM, "routed experts")
SANITIZE = SanitizeRules(
    renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    ),
    split_fused_experts=True,
)
