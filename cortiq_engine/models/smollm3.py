"""SmolLM3: a Llama trunk whose every ``no_rope_layer_interval``-th layer has no rotary
embedding (NoPE: its attention sees positions only through the causal mask), with
sliding-window attention on the layers ``layer_types`` marks, and tied embeddings.

Follows transformers' ``models/smollm3/modeling_smollm3.py`` (the oracle of the tests).
config.json's ``no_rope_layers`` is per layer 1 = RoPE, 0 = NoPE; ``ArchConfig``'s lists
the NoPE layers' indices. ``layer_types`` picks each layer's mask, as transformers'
eager and SDPA attention and its cache do (its flash-attention path alone also reads
``use_sliding_window``); without it, the config class's rule: sliding on the NoPE layers
when ``use_sliding_window`` and ``sliding_window`` are set.
"""

from __future__ import annotations

from typing import Any

from formats.arch import LAYER_SLIDING, ArchConfig
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext, GgufSpec
from cortiq_engine.models import base
from cortiq_engine.models.base import dense_common

DEFAULT_THETA = 2_000_000.0  # SmolLM3Config.default_theta, when config.json names no base


# ------------------------------------------------------------------ config.json
def _uses_rope(cfg: dict[str, Any], n: int) -> list[bool]:
    """Per layer: does it rotate? ``no_rope_layers`` (1/0 per layer, at least n entries),
    else a NoPE layer every ``no_rope_layer_interval`` layers (the (k*interval - 1)-th)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise CortiqError(f"config.json no_rope_layer_interval is {interval!r}, expected an integer >= 1")
        return [(i + 1) % interval != 0 for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise CortiqError(f"config.json no_rope_layers is {str(flags)[:60]}, expected a 1 (RoPE) or 0 (NoPE) per layer")
    return [bool(f) for f in flags[:n]]


def _smollm3(cfg: dict[str, Any]) -> ArchConfig:
    if cfg.get("mlp_bias"):
        raise CortiqError("config.json mlp_bias=true is not supported (the engine's gated MLP has no biases)")
    rp = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is None and not (isinstance(rp, dict) and rp.get("rope_theta") is not None):
        cfg = {**cfg, "rope_theta": DEFAULT_THETA}
    d = dense_common(cfg, "smollm3")
    n = d["num_layers"]
    rope = _uses_rope(cfg, n)
    window = cfg.get("sliding_window")
    lt = cfg.get("layer_types")
    if lt is None:
        slide = bool(cfg.get("use_sliding_window", False)) and window is not None
        lt = ["sliding_attention" if slide and not r else "full_attention" for r in rope]
    kinds = base.layer_kinds(lt, n)
    if LAYER_SLIDING in kinds and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise CortiqError(f"config.json sliding_window is {window!r}, the sliding layers need an integer >= 1")
    d.update(
        attention_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_types=kinds,
        sliding_window=int(window) if LAYER_SLIDING in kinds else 0,
        no_rope_layers=[i for i, r in enumerate(rope) if not r],
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ GGUF
def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """SmolLM3's config.json from a llama.cpp smollm3 GGUF. The file stores neither the
    NoPE layers nor windows: llama.cpp hard-codes a NoPE layer every 4th layer and runs
    every layer on full attention, and so does the import."""
    base.gguf_heads(ctx, config)
    base.gguf_refuse_mlp_bias(ctx)
    config.update(mlp_bias=False, no_rope_layer_interval=4, use_sliding_window=False, sliding_window=None)


# SmolLM3's converter is Llama's: q/k rows permuted for llama.cpp's interleaved RoPE.
GGUF = (GgufSpec("smollm3", "smollm3", "SmolLM3ForCausalLM", permute_qk=True, config=_gguf_config),)


PARSERS = {"smollm3": _smollm3}
COMPUTES = ("NoPE layers",)
