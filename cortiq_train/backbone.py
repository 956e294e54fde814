"""A frozen backbone: the engine's model of a CMF file, its tokenizer, and f32
copies of the few tensors the draft layers start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.arch import ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.untrusted_json import section
from formats.sidecar import ROLE_MODEL
from formats.tokenizer_header import TOKENIZER_TENSOR
from cortiq_engine.models import FAMILIES, build_model, read_arch

@dataclass(eq=False)
class Backbone:
    path: Path
    cmf: CmfFile
    header: dict[str, Any]
    arch: ArchConfig
    model: Any  # cortiq_engine.model.Model
    tokenizer: Any  # cortiq_engine.tokenizer.Tokenizer

    @property
    def fingerprint(self) -> str | None:
        fp = section(self.header, "source").get("fingerprint")
        return fp if isinstance(fp, str) else None

    def block_f32(self, layer: int) -> dict[str, np.ndarray]:
        """f32 copies of backbone layer ``layer``'s tensors (as its family's manifest lists
        them, optional ones when present), named relative to the block."""
        p = f"model.layers.{layer}."
        block = FAMILIES.for_arch(self.arch.arch).manifest(self.arch, ()).under(p)
        out = {n: self.cmf.tensor_f32(p + n) for n in block.required}
        out.update({n: self.cmf.tensor_f32(p + n) for n in block.optional if p + n in self.cmf})
        return out

    def head_f32(self) -> np.ndarray:
        """The lm_head [vocab, hidden] in f32 (the drafts share it, frozen)."""
        return self.model.head.dequantize()

    def embed_f32(self, ids: np.ndarray) -> np.ndarray:
        return self.model.embed_ids(ids)

    def final_norm_weight(self) -> np.ndarray:
        """The effective scale of the final norm (``rms_one`` stores scale - 1)."""
        w = self.cmf.tensor_f32("model.norm.weight").astype(np.float32)
        return w + 1.0 if self.arch.norm_style == "rms_one" else w

    def close(self) -> None:
        self.cmf.close()


def open_backbone(path: str | Path, kernels: str | None = None) -> Backbone:
    """Open ``path`` for training; one-line errors for files that cannot be a backbone."""
    from cortiq_engine.kernels import get_kernels
    from cortiq_engine.tokenizer import Tokenizer

    path = Path(path)
    cmf = CmfFile(path)
    header = cmf.header
    if header.get("role", ROLE_MODEL) != ROLE_MODEL:
        cmf.close()
        raise CortiqError(f"{path}: not a model file (role {header.get('role')!r}); give the backbone .cmf")
    if TOKENIZER_TENSOR not in cmf:
        cmf.close()
        raise CortiqError(f"{path}: the file has no tokenizer (mtp-train tokenizes the training text)")
    if not isinstance(header.get("arch"), dict):
        cmf.close()
        raise CortiqError(f"{path}: the header has no arch section")
    try:
        arch = read_arch(cmf)
    except CortiqError:
        cmf.close()
        raise
    model = build_model(cmf, arch, get_kernels(kernels))
    tok = Tokenizer(cmf.raw_bytes(TOKENIZER_TENSOR), section(header, "tokenizer", str(path)), name=path.name)
    return Backbone(path, cmf, header, arch, model, tok)
