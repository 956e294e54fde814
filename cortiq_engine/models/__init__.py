"""One module per architecture family; ``build_model`` dispatches on ``arch.arch``."""

from __future__ import annotations

from typing import Callable

from formats.arch import ArchConfig
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.model import Model
from cortiq_engine.models import gemma3, llama, mimo_v2, moe_family, qwen3_next

# arch name (formats.arch) -> builder(cmf, arch, kernels) -> Model
BUILDERS: dict[str, Callable[[CmfFile, ArchConfig, object], Model]] = {
    "llama": llama.build,
    "mistral": llama.build,
    "qwen2": llama.build,
    "qwen3": llama.build,
    "qwen2_moe": moe_family.build,
    "qwen3_moe": moe_family.build,
    "mixtral": moe_family.build,
    "qwen3_next": qwen3_next.build,
    "qwen3_5": qwen3_next.build,
    "qwen3_5_moe": qwen3_next.build,
    "mimo_v2": mimo_v2.build,
    "gemma3": gemma3.build,
}


def build_model(cmf: CmfFile, arch: ArchConfig, kernels) -> Model:
    try:
        builder = BUILDERS[arch.arch]
    except KeyError:
        raise CortiqError(
            f"{cmf.path}: the engine cannot run architecture {arch.arch!r} yet (supported: {', '.join(sorted(BUILDERS))})"
        ) from None
    return builder(cmf, arch, kernels)
