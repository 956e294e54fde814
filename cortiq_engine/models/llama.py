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

from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from formats.manifest import Manifest
from cortiq_engine.model import Model
from cortiq_engine.models import blocks
from cortiq_engine.models.base import Family, dense_common, sliding_layers


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
def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    return blocks.prenorm_manifest(arch).update(blocks.draft_manifests(arch, mtp_layers))


# ------------------------------------------------------------------ the trunk
def _check(cmf: CmfFile, arch: ArchConfig) -> None:
    if arch.moe is not None:
        raise CortiqError(f"{cmf.path}: mixture-of-experts layers are not supported by the engine yet")
    bad = sorted({t for t in arch.layer_types if t not in (LAYER_FULL, LAYER_SLIDING)})
    if bad:
        raise CortiqError(f"{cmf.path}: layer types {bad} are not supported by the engine yet")
    if arch.attn_output_gate or arch.attention_sinks or arch.sliding is not None:
        raise CortiqError(f"{cmf.path}: gated/sink/split-geometry attention is not supported by the engine yet")


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    _check(cmf, arch)
    return blocks.prenorm_model(cmf, arch, kernels)


# ------------------------------------------------------------------ GGUF
def _gguf_llama(ctx: GgufContext, config: dict[str, Any]) -> None:
    bias = [f"blk.0.attn_{p}.bias" in ctx.tensors for p in ("q", "k", "v", "output")]
    if any(bias) and not all(bias):
        raise CortiqError("GGUFs with biases on only some attention projections are not supported")
    config.update(mlp_bias=False, pretraining_tp=1)


def _gguf_qwen(ctx: GgufContext, config: dict[str, Any]) -> None:
    bias = [f"blk.0.attn_{p}.bias" in ctx.tensors for p in ("q", "k", "v", "output")]
    if config["model_type"] == "qwen2":
        config["attention_bias"] = True  # q/k/v biases always, o_proj never (the manifest checks)
    elif any(bias) and not all(bias):
        raise CortiqError("GGUFs with biases on only some attention projections are not supported")
    config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])


def _check_gguf_geometry(ctx: GgufContext, config: dict[str, Any]) -> None:
    hd = config["head_dim"]
    if int(ctx.key("attention.value_length", hd)) != hd:
        raise CortiqError("GGUFs with different key and value head sizes are not supported")
    if int(ctx.key("rope.dimension_count", hd)) != hd:
        raise CortiqError("partial rotary embeddings (rope.dimension_count < head size) are not supported")


def _with_geometry(hook):
    def run(ctx: GgufContext, config: dict[str, Any]) -> None:
        _check_gguf_geometry(ctx, config)
        hook(ctx, config)

    return run


GGUF = (
    GgufSpec("llama", "llama", "LlamaForCausalLM", permute_qk=True, config=_with_geometry(_gguf_llama)),
    GgufSpec("qwen2", "qwen2", "Qwen2ForCausalLM", config=_with_geometry(_gguf_qwen)),
    GgufSpec("qwen3", "qwen3", "Qwen3ForCausalLM", config=_with_geometry(_gguf_qwen)),
)


FAMILY = Family(
    name="llama",
    parsers={"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": qwen3},
    archs=("llama", "mistral", "qwen2", "qwen3"),
    manifest=manifest,
    build=build,
    draft_layer=blocks.dense_draft_layer,
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    gguf=GGUF,
)
