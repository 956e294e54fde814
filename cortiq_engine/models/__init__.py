"""One file per architecture family: the module is the family, as in mlx_lm.

Every module in this package that defines ``PARSERS`` is an architecture, read into a
``base.Family`` by the names of ``base.FAMILY_NAMES``: adding one is adding a file (see
docs/architectures.md, "How to add an architecture"). ``FAMILIES`` finds a family by a config.json's ``model_type`` or
by a CMF header's ``arch``; ``formats`` (the converter, the header check) takes it
as an argument, since formats does not import the engine.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Iterable

from formats.arch import ArchConfig
from formats.arch_check import arch_from_config, model_arch
from formats.cmf import CmfFile
from formats.errors import CortiqError
from cortiq_engine.models.base import DraftLayer, Family
from formats.gguf_spec import GgufSpec


@dataclass(frozen=True)
class Registry:
    """The families, by ``model_type``, by ``arch`` and by GGUF architecture; each is
    checked to be unique."""

    families: tuple[Family, ...]
    by_model_type: dict[str, Family] = field(init=False, repr=False)
    by_arch: dict[str, Family] = field(init=False, repr=False)
    by_gguf: dict[str, tuple[Family, GgufSpec]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        mts: dict[str, Family] = {}
        archs: dict[str, Family] = {}
        gguf: dict[str, tuple[Family, GgufSpec]] = {}
        for f in self.families:
            for key, table in ((f.model_types, mts), (f.archs, archs)):
                for k in key:
                    if k in table:
                        raise ValueError(f"{k!r} is claimed by families {table[k].name} and {f.name}")
                    table[k] = f
            for spec in f.gguf:
                if spec.arch in gguf:
                    raise ValueError(
                        f"GGUF architecture {spec.arch!r} is claimed by families {gguf[spec.arch][0].name} and {f.name}"
                    )
                if spec.model_type not in f.model_types:
                    raise ValueError(
                        f"family {f.name}'s GGUF {spec.arch!r} names model_type {spec.model_type!r}, which it does not parse"
                    )
                gguf[spec.arch] = (f, spec)
        object.__setattr__(self, "by_model_type", mts)
        object.__setattr__(self, "by_arch", archs)
        object.__setattr__(self, "by_gguf", gguf)

    def supported_model_types(self) -> list[str]:
        return sorted(self.by_model_type)

    def for_model_type(self, model_type: Any) -> Family:
        if not isinstance(model_type, str) or model_type not in self.by_model_type:
            raise CortiqError(
                f"unsupported architecture {_show(model_type)} (model_type in config.json); "
                f"supported: {', '.join(self.supported_model_types())}; see {DOCS}"
            )
        return self.by_model_type[model_type]

    def for_gguf_arch(self, arch: Any) -> tuple[Family, GgufSpec]:
        if not isinstance(arch, str) or arch not in self.by_gguf:
            raise CortiqError(
                f"unsupported GGUF architecture {_show(arch)} (general.architecture); "
                f"supported: {', '.join(sorted(self.by_gguf))}; see {DOCS}"
            )
        return self.by_gguf[arch]

    def for_arch(self, arch: Any) -> Family:
        if not isinstance(arch, str) or arch not in self.by_arch:
            raise CortiqError(
                f"the engine cannot run architecture {arch!r} yet (supported: {', '.join(sorted(self.by_arch))})"
            )
        return self.by_arch[arch]


DOCS = "docs/architectures.md"


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _discover(modules: Iterable[str]) -> tuple[Family, ...]:
    found = []
    for name in sorted(modules):
        module = importlib.import_module(f"{__name__}.{name}")
        if hasattr(module, "PARSERS"):
            found.append(Family.of_module(module))
    return tuple(found)


FAMILIES = Registry(_discover(m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg))


def supported_model_types() -> list[str]:
    return FAMILIES.supported_model_types()


def parse_config(cfg: dict[str, Any]) -> ArchConfig:
    """The validated ``ArchConfig`` of a config.json (its family found by ``model_type``)."""
    return arch_from_config(FAMILIES, cfg)[1]


def read_arch(cmf: CmfFile, trunk: bool = True) -> ArchConfig:
    """The validated ``ArchConfig`` of an open CMF file, its tensors checked against
    its family's manifest (``trunk=False``: only the draft layers of a sidecar)."""
    return model_arch(cmf, FAMILIES, trunk=trunk)


def build_model(cmf: CmfFile, arch: ArchConfig, kernels):
    """The trunk ``Model`` of ``cmf`` (``arch`` from ``read_arch``)."""
    try:
        family = FAMILIES.for_arch(arch.arch)
    except CortiqError as e:
        raise CortiqError(f"{cmf.path}: {e}") from None
    return family.model(cmf, arch, kernels)


def draft_layer(cmf: CmfFile, k: int, arch: ArchConfig, kernels) -> DraftLayer:
    """MTP layer ``k`` of ``cmf`` as the backbone's family builds it: the one draft-layer
    loader (speculative decoding, the probe and mtp-train all come here)."""
    return FAMILIES.for_arch(arch.arch).draft_layer(cmf, k, arch, kernels)
