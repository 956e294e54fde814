"""A sidecar's draft layers run by the engine's own layers and kernels (numpy or
numba, whatever the backbone uses), teacher-forced over whole windows.

This measures a written sidecar as the engine computes it (quantized weights
included) without the speculative decoder: the check that the file says what the
trainer trained, and the held-out acceptance the report quotes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.layers import Step
from cortiq_engine.models.base import DraftLayer
from cortiq_engine.mtp import load_draft_stack


def load_draft_layers(sidecar: str | Path, backbone) -> list[DraftLayer]:
    """The draft layers of ``sidecar`` on the backbone's kernels, through the engine's one
    loader (``cortiq_engine.mtp.load_draft_stack``: the sidecar checked against the
    backbone, each layer built by the backbone's family)."""
    stack = load_draft_stack(backbone.cmf, backbone.arch, backbone.model.kernels, path=sidecar)
    if stack is None:  # load_draft_stack returns None only when it is given no path
        raise CortiqError(f"{sidecar}: no draft layers")
    return list(stack.layers)


def layer_hidden(backbone, layer: DraftLayer, emb: np.ndarray, hid: np.ndarray) -> np.ndarray:
    """Teacher-forced rows of one draft layer: emb, hid [n, H] -> final-normed [n, H]."""
    n = emb.shape[0]
    x = layer(backbone.model.kernels, emb, hid, layer.make_cache(n), Step(np.arange(n, dtype=np.int64)))
    return layer.final_norm(x)


def engine_drafts(
    backbone, layers: list[DraftLayer], tokens: np.ndarray, hidden: np.ndarray, head_rows: int = 64
) -> list[np.ndarray]:
    """Argmax drafts [W, T] per depth over the windows (tokens [W, T], hidden [W, T, H])."""
    w, t = tokens.shape
    out = [np.full((w, t), -1, np.int64) for _ in layers]
    for i in range(w):
        for k, layer in enumerate(layers):
            n = t - k - 1
            y = layer_hidden(backbone, layer, backbone.model.embed_ids(tokens[i, k + 1 : t]), hidden[i, :n])
            for r0 in range(0, n, head_rows):
                r1 = min(r0 + head_rows, n)
                out[k][i, r0:r1] = backbone.model.lm_head(y[r0:r1]).argmax(-1)
    return out
