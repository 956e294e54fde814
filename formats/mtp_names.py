"""Which checkpoint tensors are multi-token-prediction draft layers, and their CMF names.

Every MTP naming scheme is normalized to ``model.mtp.layers.{k}.*``:

- DeepSeek-V3 style: ``model.layers.{num_hidden_layers + k}.*`` with ``num_nextn_predict_layers``;
  the per-layer ``embed_tokens`` / ``shared_head.head`` copies duplicate the trunk's and are dropped,
  ``shared_head.norm`` becomes ``final_layernorm``.
- MiMo-V2: ``model.mtp.layers.{k}.*`` (its ``pre_mlp_layernorm`` and ``self_attn.attention_sink_bias``
  become ``post_attention_layernorm`` and ``self_attn.sinks``).
- Qwen3-Next / Qwen3.5: ``mtp.layers.{k}.*``, ``mtp.fc`` (eh_proj), ``mtp.pre_fc_norm_embedding``
  (enorm), ``mtp.pre_fc_norm_hidden`` (hnorm), ``mtp.norm`` (final_layernorm).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

MTP_PREFIX = "model.mtp.layers."


def mtp_layer_count(config: dict[str, Any]) -> int:
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        v = config.get(key)
        if v:
            return int(v)
    return 0


# MiMo-V2 release names inside its MTP layers -> the names every other family uses.
_MIMO_ALIASES = {".pre_mlp_layernorm.": ".post_attention_layernorm.", ".self_attn.attention_sink_bias": ".self_attn.sinks"}


def _mimo_alias(name: str) -> str:
    for old, new in _MIMO_ALIASES.items():
        name = name.replace(old, new)
    return name


def normalize(name: str, config: dict[str, Any]) -> tuple[str | None, bool]:
    """(CMF name or None to drop, is an MTP tensor)."""
    n_main = int(config.get("num_hidden_layers", 0))
    m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if m and int(m.group(1)) >= n_main and mtp_layer_count(config):
        k = int(m.group(1)) - n_main
        rest = m.group(2)
        if rest.startswith("embed_tokens.") or rest.startswith("shared_head.head."):
            return None, True
        if rest.startswith("shared_head.norm."):
            rest = "final_layernorm." + rest[len("shared_head.norm.") :]
        return f"{MTP_PREFIX}{k}.{rest}", True
    if name.startswith(MTP_PREFIX):
        return _mimo_alias(name), True
    if name.startswith("mtp."):
        rest = name[len("mtp.") :]
        m = re.match(r"layers\.(\d+)\.(.*)", rest)
        if m:
            return f"{MTP_PREFIX}{m.group(1)}.{m.group(2)}", True
        # Qwen3-Next keeps one set of shared pieces around its single layer.
        renames = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "norm.": "final_layernorm."}
        for old, new in renames.items():
            if rest.startswith(old):
                return f"{MTP_PREFIX}0.{new}{rest[len(old):]}", True
        return f"{MTP_PREFIX}0.{rest}", True
    return name, False


def naming_scheme(sources: Iterable[str]) -> str:
    """Which release scheme names the MTP tensors ``sources`` (checkpoint names): "mimo"
    (``model.mtp.layers.*``), "qwen3_next" (``mtp.*``) or "deepseek" (``model.layers.{N+k}``).
    The style recorded for a family whose ``Family.mtp_style`` does not fix it."""
    sources = list(sources)
    if any(s.startswith(MTP_PREFIX) for s in sources):
        return "mimo"
    if any(s.startswith("mtp.") for s in sources):
        return "qwen3_next"
    return "deepseek"
