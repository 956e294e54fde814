"""Write trained draft layers as a standard MTP sidecar beside their backbone.

The header is the one the converter writes for a sidecar it cuts from a checkpoint
(role ``mtp_sidecar``, the backbone's arch with its ``mtp`` section, the
``backbone`` identity ``check_sidecar`` compares), plus a ``trained`` record of how
the layers were made. Matrices take the backbone's quantization unless told.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from formats.cmf import FORMAT_MINOR, FORMAT_VERSION, CmfWriter
from formats.errors import CortiqError
from formats.policy import QuantPolicy
from formats.sidecar import DRAFT_VOCAB_TENSOR, ROLE_SIDECAR, backbone_identity, check_sidecar

MTP_STYLE = "mimo"  # independent layers: layer k drafts depth k+1 from the backbone hidden
TRAINER_NAME = "cortiq mtp-train"


def sidecar_header(
    main_header: dict[str, Any],
    main_name: str,
    n_layers: int,
    quant: str,
    intermediate: int,
    hidden: str,
    trained: dict[str, Any],
) -> dict[str, Any]:
    arch = copy.deepcopy(main_header["arch"])
    arch["mtp"] = {"num_layers": n_layers, "style": MTP_STYLE}
    mtp = {
        "num_layers": n_layers,
        "style": MTP_STYLE,
        "location": "sidecar",
        "chain": "independent",
        "hidden": hidden,
        "intermediate_size": intermediate,
        "ffn_intermediate_sizes": [intermediate] * n_layers,
    }
    return {
        "format": "cmf",
        "format_version": f"{FORMAT_VERSION}.{FORMAT_MINOR}",
        "role": ROLE_SIDECAR,
        "arch": arch,
        "mtp": mtp,
        "backbone": backbone_identity(main_header, main_name),
        "source": main_header.get("source"),
        "converter": {"name": TRAINER_NAME, "version": "0.1.0"},
        "quant": {"default": quant, "keep": []},
        "trained": trained,
    }


def write_sidecar(
    out: Path,
    main_header: dict[str, Any],
    main_name: str,
    tensors: dict[str, np.ndarray],
    *,
    quant: str,
    hidden: str,
    trained: dict[str, Any],
    force: bool = False,
    draft_vocab: tuple[np.ndarray, dict[str, Any]] | None = None,
) -> Path:
    """Encode ``tensors`` (sidecar names -> f32) into ``out``; returns the path.
    ``draft_vocab``: (ids most useful first, its header record), see formats/sidecar.py."""
    layers = sorted({int(n.split(".")[3]) for n in tensors})
    if layers != list(range(len(layers))):
        raise AssertionError(f"draft layers {layers} are not numbered 0..K-1")
    inter = int(tensors["model.mtp.layers.0.mlp.gate_proj.weight"].shape[0])
    header = sidecar_header(main_header, main_name, len(layers), quant, inter, hidden, trained)
    check_sidecar(main_header, header)  # the engine will run the same check on load
    if draft_vocab is not None:
        header["mtp"]["draft_vocab"] = draft_vocab[1]
    policy = QuantPolicy(quant)
    if out.exists() and not force:
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    with CmfWriter(out, header, force=True) as w:
        for name in sorted(tensors):
            a = np.ascontiguousarray(tensors[name], dtype=np.float32)
            if not np.isfinite(a).all():
                raise CortiqError(f"training diverged: {name} has NaN or Inf (lower --lr)")
            w.add(name, policy.dtype_for(name, a.shape), a)
        if draft_vocab is not None:
            w.add(DRAFT_VOCAB_TENSOR, "i32", np.asarray(draft_vocab[0], dtype=np.int64))
    return out
