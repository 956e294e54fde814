"""Which CMF dtype each tensor gets when a checkpoint is converted."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from formats.errors import CortiqError
from formats.quants import QUANT_CHOICES, get_dtype

EMBED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# Routers decide discrete choices from tiny matrices: keep them exact. So are the
# Gated DeltaNet depthwise conv kernels (a few values per channel).
_EXACT_SUFFIXES = (".mlp.gate.weight", ".shared_expert_gate.weight", ".linear_attn.conv1d.weight")
FALLBACK_DTYPE = "f16"


@dataclass
class QuantPolicy:
    """The dtype rules, in order:

    1. tensors with fewer than 2 dims (norms, biases, sinks) stay f32;
    2. the first ``keep`` pattern (fnmatch on the CMF name) that matches decides;
    3. otherwise routers stay f32, and with ``q4`` the embeddings and lm_head get
       q8 (as llama.cpp keeps its output tensor at higher precision); everything
       else gets ``quant``;
    4. a quantized dtype that does not fit the shape (last dim not a multiple of
       32) falls back to f16.
    """

    quant: str
    keep: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_CHOICES:
            raise CortiqError(f"unknown --quant {self.quant!r}; choose one of {', '.join(QUANT_CHOICES)}")
        for pat, dt in self.keep:
            if dt not in QUANT_CHOICES:
                raise CortiqError(f"--keep {pat}={dt}: unknown dtype {dt!r}; choose one of {', '.join(QUANT_CHOICES)}")

    @staticmethod
    def parse_keep(specs: list[str]) -> list[tuple[str, str]]:
        out = []
        for s in specs:
            pat, sep, dt = s.rpartition("=")
            if not sep or not pat.strip() or not dt.strip():
                raise CortiqError(f"--keep {s!r}: expected PATTERN=DTYPE, e.g. 'lm_head.weight=q8'")
            out.append((pat.strip(), dt.strip()))
        return out

    def matching_keep(self, name: str) -> tuple[str, str] | None:
        for pat, dt in self.keep:
            if fnmatch.fnmatchcase(name, pat):
                return pat, dt
        return None

    def choose(self, name: str, shape: tuple[int, ...]) -> tuple[str, bool]:
        """(dtype, True if a quantized choice fell back because of the shape)."""
        if len(shape) < 2:
            return "f32", False
        kept = self.matching_keep(name)
        if kept is not None:
            chosen = kept[1]
        elif name.endswith(_EXACT_SUFFIXES):
            chosen = "f32"
        elif self.quant == "q4" and name in EMBED_NAMES:
            chosen = "q8"
        else:
            chosen = self.quant
        if not get_dtype(chosen).supports(shape):
            return FALLBACK_DTYPE, True
        return chosen, False

    def dtype_for(self, name: str, shape: tuple[int, ...]) -> str:
        return self.choose(name, shape)[0]
