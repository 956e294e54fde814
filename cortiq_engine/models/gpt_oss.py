"""GPT-OSS (``GptOssForCausalLM``): pre-norm blocks whose attention alternates between a
sliding window and full causal attention (``layer_types``), with q/k/v/o biases, a
learned sink logit per head and YaRN RoPE; every FFN is a routed MoE whose router has a
bias (top-k of the logits, softmax over the k), whose experts have biases and a clamped
SwiGLU: gate clamped above at ``swiglu_limit``, up to +-``swiglu_limit``,
``out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)``.

Follows transformers' ``models/gpt_oss/modeling_gpt_oss.py`` (the oracle of the tests).

Checkpoint names: ``mlp.router`` -> ``mlp.gate``; the fused experts (``gate_up_proj``
[E, H, 2I] with gate/up interleaved along the last dim, ``down_proj`` [E, I, H], their
biases, or the release's MXFP4 ``*_blocks`` / ``*_scales``) become per-expert
``mlp.experts.E.{gate,up,down}_proj.{weight,bias}`` (``formats.sanitize.InterleavedExperts``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig, MoeConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from formats.manifest import Manifest
from formats.sanitize import SanitizeRules
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import Family, Geometry, dense_common, req

_LAYER_KINDS = {"sliding_attention": LAYER_SLIDING, "full_attention": LAYER_FULL}


# ------------------------------------------------------------------ config.json
def _positive(cfg: dict[str, Any], key: str, default: float) -> float:
    v = cfg.get(key)
    v = default if v is None else float(v)
    if not (math.isfinite(v) and v > 0):
        raise CortiqError(f"config.json {key} is {v}, expected a finite number > 0")
    return v


def _gpt_oss(cfg: dict[str, Any]) -> ArchConfig:
    """GPT-OSS: sliding/full layers, sinks, biased attention, YaRN, a biased router and
    biased experts with the clamped SwiGLU; an MXFP4 release's experts decode on convert."""
    q = cfg.get("quantization_config")
    if q is not None and not (isinstance(q, dict) and q.get("quant_method") == "mxfp4"):
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CortiqError(f"gpt_oss quantization_config quant_method {method!r} is not supported (supported: mxfp4)")
    d = dense_common(cfg, "gpt_oss")
    n = d["num_layers"]
    lt = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not isinstance(lt, list) or len(lt) != n:
        raise CortiqError(f"gpt_oss layer_types has {len(lt) if isinstance(lt, list) else lt!r} entries for {n} layers")
    bad = sorted({str(t) for t in lt if t not in _LAYER_KINDS})
    if bad:
        raise CortiqError(f"gpt_oss layer_types {bad} are not supported (supported: sliding_attention, full_attention)")
    d["layer_types"] = [_LAYER_KINDS[t] for t in lt]
    window = cfg.get("sliding_window")
    if LAYER_SLIDING in d["layer_types"] and not window:
        raise CortiqError("gpt_oss has sliding_attention layers but no sliding_window")
    d["sliding_window"] = int(window or 0) if LAYER_SLIDING in d["layer_types"] else 0
    d["attention_bias"] = bool(cfg.get("attention_bias", True))
    d["attention_sinks"] = True
    d["norm_eps"] = float(cfg.get("rms_norm_eps") or 1e-5)
    d["moe"] = MoeConfig(
        num_experts=int(req(cfg, "num_local_experts")),
        # the release's config.json also names it experts_per_token
        top_k=int(cfg.get("num_experts_per_tok") or req(cfg, "experts_per_token")),
        expert_intermediate_size=d["intermediate_size"],
        # top-k of the logits then softmax over the k == softmax, top-k, renormalized
        norm_topk_prob=True,
        moe_layers=list(range(n)),
        router_bias=True,
        expert_bias=True,
        swiglu_limit=_positive(cfg, "swiglu_limit", 7.0),
        swiglu_alpha=_positive(cfg, "swiglu_alpha", 1.702),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Per layer: the two norms, biased attention with sinks, the biased MoE (every layer)."""
    h, m = arch.hidden_size, base.trunk_ends(arch)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        m.update(base.norms(p, h, "input_layernorm", "post_attention_layernorm"))
        att = base.attention(p, h, Geometry.full(arch), sinks=True)
        if arch.attention_bias:  # the release always has them: refuse a file that lost them
            att.required.update(att.optional)
            att.optional.clear()
        m.update(att)
        m.update(base.ffn(arch, p, i))
    return m.update(blocks.draft_manifests(arch, mtp_layers, routed=True))


# ------------------------------------------------------------------ the trunk
def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    mc = arch.moe
    if mc is None or mc.moe_layers != list(range(arch.num_layers)) or not (mc.router_bias and mc.expert_bias):
        raise CortiqError(f"{cmf.path}: gpt_oss needs a biased MoE on every layer")
    if mc.scoring != "softmax" or not mc.norm_topk_prob or mc.shared_expert_intermediate_size:
        raise CortiqError(f"{cmf.path}: gpt_oss routes by softmax over the top-k without a shared expert")
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad or arch.sliding is not None or arch.linear_attn is not None or arch.mla is not None:
        raise CortiqError(f"{cmf.path}: gpt_oss with layer types {bad or arch.layer_types} or split-geometry layers")
    if not arch.attention_sinks or arch.attn_output_gate or arch.qk_norm or arch.attn_logit_softcapping:
        raise CortiqError(f"{cmf.path}: gpt_oss attention has sinks, no output gate, no q/k norm, no soft-cap")


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    _check(cmf, arch)
    rope = blocks.rope(arch)
    layers = []
    for i, kind in enumerate(arch.layer_types):
        attn = blocks.attention(cmf, arch, kernels, f"model.layers.{i}.", kind, rope)
        layers.append(blocks.ffn_block(cmf, arch, kernels, i, attn))
    embed, head, norm = blocks.head_and_norm(cmf, arch, kernels)
    return Model(arch=arch, kernels=kernels, embed=embed, blocks=tuple(layers), norm=norm, head=head)


# ------------------------------------------------------------------ GGUF
def _gguf_int(ctx: GgufContext, key: str, lo: int = 1) -> int:
    v = ctx.key(key, required=True)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CortiqError(f"GGUF metadata gpt-oss.{key} is {str(v)[:40]!r}, expected an integer >= {lo}")
    return int(v)


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """GPT-OSS's config.json from llama.cpp's ``gpt-oss.*`` keys: experts, their width
    (``expert_feed_forward_length``), the window (llama.cpp alternates sliding and full
    layers from the first, as transformers' default ``layer_types`` does) and YaRN, whose
    betas and ``truncate`` llama.cpp's converter does not write: GPT-OSS's fixed values."""
    config.update(
        num_local_experts=_gguf_int(ctx, "expert_count"),
        num_experts_per_tok=_gguf_int(ctx, "expert_used_count"),
        intermediate_size=_gguf_int(ctx, "expert_feed_forward_length"),
        sliding_window=_gguf_int(ctx, "attention.sliding_window"),
    )
    rs = config.get("rope_scaling")
    if rs is not None:
        if rs.get("rope_type") != "yarn":
            raise CortiqError(f"gpt-oss GGUF rope scaling {rs.get('rope_type')!r} is not supported (supported: yarn)")
        betas = {}
        for name, key, default in (("beta_fast", "yarn_beta_fast", 32.0), ("beta_slow", "yarn_beta_slow", 1.0)):
            v = ctx.key(f"rope.scaling.{key}", default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CortiqError(f"GGUF metadata gpt-oss.rope.scaling.{key} is {str(v)[:40]!r}, expected a number > 0")
            betas[name] = float(v)
        rs.update(betas, truncate=False)


GGUF = GgufSpec(
    "gpt-oss",
    "gpt_oss",
    "GptOssForCausalLM",
    # llama.cpp's experts are stacked [experts, out, in] per projection, gate and up apart.
    block_names={
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
        "ffn_up_exps": "mlp.experts.{e}.up_proj",
        "ffn_down_exps": "mlp.experts.{e}.down_proj",
    },
    full_names={"attn_sinks": "self_attn.sinks"},  # attn_sinks.weight: the engine's self_attn.sinks
    config=_gguf_config,
)


FAMILY = Family(
    name="gpt_oss",
    parsers={"gpt_oss": _gpt_oss},
    archs=("gpt_oss",),
    manifest=manifest,
    build=build,
    draft_layer=blocks.routed_draft_layer,
    sanitize=SanitizeRules(
        renames=((r"\.mlp\.router\.", ".mlp.gate."),),
        interleaved_experts=True,
    ),
    hf_architectures=("GptOssForCausalLM",),
    gguf=(GGUF,),
)
