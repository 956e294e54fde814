"""Gemma 3 (text): interleaved sliding-window (local) and global attention layers,
each kind with its own RoPE base; per-head q/k RMS norms; four (1 + w) RMS norms per
block (before and after attention, before and after the MLP); a GeGLU MLP with the
tanh-approximated GELU; embeddings scaled by sqrt(hidden); scores scaled by
``query_pre_attn_scalar``**-0.5; tied embeddings; an optional tanh cap on the logits.

Follows transformers' ``models/gemma3/modeling_gemma3.py`` (the oracle of the tests).
The walk-through of this file is docs/architectures.md, "How to add an architecture".
"""

from __future__ import annotations

from typing import Any, Sequence


from formats.arch import LAYER_FULL, LAYER_SLIDING, ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.gguf_spec import GgufContext
from formats.manifest import Manifest
from cortiq_engine.layers import RoPE
from cortiq_engine.model import Model
from cortiq_engine.models import base, blocks
from cortiq_engine.models.base import Geometry, dense_common
from cortiq_engine.models.blocks import GELU_TANH


# ------------------------------------------------------------------ config.json
def _gemma3(cfg: dict[str, Any]) -> ArchConfig:
    """Gemma 3 text: every 6th layer global, the rest sliding with their own RoPE base;
    (1 + w) norms, q/k norms, GeGLU (tanh GELU), query_pre_attn_scalar, optional caps."""
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    full_rp = rp.get("full_attention") or {}
    local_rp = rp.get("sliding_attention") or {}
    flat = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    flat["rope_theta"] = full_rp.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    flat.setdefault("rope_scaling", None)
    if full_rp.get("rope_type", "default") not in (None, "default"):
        flat["rope_scaling"] = {k: v for k, v in full_rp.items() if k != "rope_theta"}
    flat["hidden_act"] = cfg.get("hidden_activation") or cfg.get("hidden_act") or GELU_TANH
    d = dense_common(flat, "gemma3")
    n = d["num_layers"]
    kinds = base.layer_kinds(
        cfg.get("layer_types") or base.every_nth_full(n, int(cfg.get("sliding_window_pattern") or 6)), n
    )
    if cfg.get("use_bidirectional_attention"):
        raise CortiqError("gemma3 with use_bidirectional_attention is not supported (an encoder, not a causal LM)")
    d.update(
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        norm_style="rms_one",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        layer_types=kinds,
        sliding_window=int(cfg.get("sliding_window") or 4096),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
        rope_local_theta=float(local_rp.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0),
    )
    return ArchConfig(**d)


# ------------------------------------------------------------------ manifest
def manifest(arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest:
    """Per layer: the four sandwich norms, attention with q/k norms, the GeGLU MLP.
    Draft layers (none ship with Gemma 3) are Llama draft blocks."""

    def attention(p: str) -> Manifest:
        return base.attention(p, arch.hidden_size, Geometry.full(arch), qk_norm=True)

    return blocks.sandwich_manifest(arch, mtp_layers, attention)


# ------------------------------------------------------------------ the model
# What a Gemma 3 header may ask for (``base.SETTINGS``); the rest is refused. Not an
# attention soft-cap: transformers' Gemma 3 and llama.cpp ignore it, so a value there
# names no model either computes.
COMPUTES = ("q/k norms", "(1 + w) norms", "query_pre_attn_scalar", "a final soft-cap", "a local RoPE base")


def build(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    if arch.norm_style != "rms_one":
        raise CortiqError(f"{cmf.path}: gemma3 norms are (1 + w)")
    if arch.rope_scaling and arch.rope_scaling.get("rope_type", arch.rope_scaling.get("type")) not in (
        "linear",
        "llama3",
    ):
        raise CortiqError(f"{cmf.path}: rope scaling {arch.rope_scaling!r} is not supported for gemma3")
    # The global layers use rope_theta (and any scaling); the local ones their own base, unscaled.
    ropes = {
        LAYER_FULL: RoPE(arch.rotary_dim, arch.rope_theta, arch.rope_scaling),
        LAYER_SLIDING: RoPE(arch.rotary_dim, arch.rope_local_theta or arch.rope_theta, None),
    }

    def attention(p: str, kind: str):
        return blocks.attention(cmf, arch, kernels, p, kind, ropes[kind])  # q/k norms get (1 + w): norm_style rms_one

    return blocks.sandwich_model(cmf, arch, kernels, attention, **blocks.gemma_trunk_options(arch))


# ------------------------------------------------------------------ GGUF
# The chat template of Google's Gemma 3 releases (tokenizer_config.json of
# google/gemma-3-*-it), used when a gemma3 GGUF carries none (many conversions of the
# base models do not): llama.cpp then falls back to its built-in "gemma" format, which
# renders the same turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


def _gguf_config(ctx: GgufContext, config: dict[str, Any]) -> None:
    """Gemma 3's config.json. What the GGUF does not store, llama.cpp hard-codes for
    gemma3 and so do we: every 6th layer global, a local RoPE base of 10000, and
    query_pre_attn_scalar = head_dim (the 27B model's hidden/heads differs; llama.cpp
    special-cases it by size, which a GGUF does not name, so it is refused below)."""
    base.gguf_heads(ctx, config)
    layers, hd = config["num_hidden_layers"], config["head_dim"]
    scaling = config.pop("rope_scaling", None)
    theta = config.pop("rope_theta")
    if config["hidden_size"] == 5376 and layers == 62:
        raise CortiqError("Gemma 3 27B GGUFs are not supported (their query scale is not stored in the file)")
    window = ctx.key("attention.sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CortiqError(f"gemma3 GGUF has no valid gemma3.attention.sliding_window ({str(window)[:40]!r})")
    full = {"rope_type": "default", "rope_theta": theta if "gemma3.rope.freq_base" in ctx.meta else 1_000_000.0}
    if scaling is not None:
        if scaling.get("rope_type") != "linear":
            raise CortiqError(
                f"gemma3 GGUF rope scaling {scaling.get('rope_type')!r} is not supported (supported: linear)"
            )
        full.update(scaling)
    caps = {}
    for k in ("final_logit_softcapping", "attn_logit_softcapping"):
        v = ctx.key(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            raise CortiqError(f"GGUF metadata gemma3.{k} is {str(v)[:40]!r}, expected a number >= 0")
        caps[k] = v
    config.update(
        hidden_activation=GELU_TANH,
        hidden_act=GELU_TANH,
        query_pre_attn_scalar=hd,
        sliding_window=window,
        layer_types=base.every_nth_full(layers, 6),
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        **caps,
    )


GGUF = base.gemma_gguf("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gguf_config, CHAT_TEMPLATE)


PARSERS = {"gemma3_text": _gemma3}
ACTIVATIONS = blocks.GEGLU_ACTIVATIONS
