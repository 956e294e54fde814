"""Where multi-token-prediction draft layers live in a CMF file, and how many a config.json
declares. Every draft layer is stored as ``model.mtp.layers.{k}.*``; which checkpoint
names become those is the families' business (``cortiq_engine.models.base``, the
naming schemes of the releases).
"""

from __future__ import annotations

from typing import Any

MTP_PREFIX = "model.mtp.layers."


def mtp_layer_count(config: dict[str, Any]) -> int:
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        v = config.get(key)
        if v:
            return int(v)
    return 0
