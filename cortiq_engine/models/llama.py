"""The Llama family: Llama (SmolLM2 included), Mistral, Qwen2 (q/k/v biases) and
Qwen3 (per-head q/k RMS norm). One pre-norm block per layer over the shared pieces;
what differs between the members is read from ``ArchConfig`` and from which
tensors the file holds (biases, q/k norms).

Draft layers (``draft_layer``) are the same block, full attention, over an MLP as wide
as its tensors; they may carry MiMo-style learned sinks (any family's drafts can sit
on a Llama trunk: DeepSeek-, MiMo- and Qwen3-Next-named ones all convert here).
"""

from __future__ import annotations

from typing import Any

from formats.arch import ArchConfig
from formats.gguf_spec import GgufContext, GgufSpec
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import dense_common, sliding_layers


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


# ------------------------------------------------------------------ GGUF
def _gguf_llama(ctx: GgufContext, config: dict[str, Any]) -> None:
    base.gguf_heads(ctx, config)
    base.gguf_attention_bias(ctx)
    config.update(mlp_bias=False, pretraining_tp=1)


def _gguf_qwen(ctx: GgufContext, config: dict[str, Any]) -> None:
    base.gguf_heads(ctx, config)
    if config["model_type"] == "qwen2":
        config["attention_bias"] = True  # q/k/v biases always, o_proj never (the manifest checks)
    else:
        base.gguf_attention_bias(ctx)
    config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])


GGUF = (
    GgufSpec("llama", "llama", "LlamaForCausalLM", permute_qk=True, config=_gguf_llama),
    GgufSpec("qwen2", "qwen2", "Qwen2ForCausalLM", config=_gguf_qwen),
    GgufSpec("qwen3", "qwen3", "Qwen3ForCausalLM", config=_gguf_qwen),
)


PARSERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": qwen3}
ARCHS = ("llama", "mistral", "qwen2", "qwen3")
COMPUTES = blocks.PRENORM
