"""A frozen backbone: the engine's model of a CMF file (opened by the engine's one
loader), its tokenizer, and f32 copies of the few tensors the draft layers start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.arch import ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.untrusted_json import section
from cortiq_engine.models import FAMILIES


@dataclass(eq=False)
class Backbone:
    path: Path
    cmf: CmfFile
    header: dict[str, Any]
    arch: ArchConfig
    model: Any  # cortiq_engine.model.Model
    tokenizer: Any  # cortiq_engine.tokenizer.Tokenizer
    threads: int = 1  # the engine's pools (threads.set_threads); the trainer's torch pool follows

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


def open_backbone(path: str | Path, kernels: str | None = None, threads: int | None = None) -> Backbone:
    """Open ``path`` for training through the engine's one loader (``open_trunk``: the
    thread pools, the kernels, the checks every command makes); one-line errors for
    files that cannot be a backbone."""
    from cortiq_engine.engine import open_trunk

    path = Path(path)
    trunk = open_trunk(path, threads=threads, kernels=kernels)
    if trunk.tokenizer is None:
        trunk.cmf.close()
        raise CortiqError(f"{path}: the file has no tokenizer (mtp-train tokenizes the training text)")
    return Backbone(path, trunk.cmf, trunk.header, trunk.arch, trunk.model, trunk.tokenizer, trunk.threads)
