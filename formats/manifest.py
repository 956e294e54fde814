"""The tensor manifest: the names and shapes an architecture family reads, and the
one check of a set of tensors against it.

``formats`` knows bytes, not architectures: the families live in
``cortiq_engine/models/<family>.py`` and the registry that finds them in
``cortiq_engine/models/__init__.py``. The converter and the loader take that
registry as an argument (``Families``) and ask it, through the small Protocols
below, for a family's parser, manifest and name rules; nothing here imports the
engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

from formats.arch import ArchConfig
from formats.errors import CortiqError
from formats.mtp_names import MTP_PREFIX
from formats.gguf_spec import GgufSpec
from formats.sanitize import SanitizeRules

# A tensor's expected shape; None for a width the family reads from the tensors
# themselves (a draft layer's MLP, which mtp-train may make narrower or wider).
Shape = tuple[int | None, ...]


@dataclass
class Manifest:
    """What a family reads from a model file: ``required`` tensors must be there with
    exactly their shape; ``optional`` ones (biases, a draft layer's sinks) are read
    when present and then must have their shape."""

    required: dict[str, Shape] = field(default_factory=dict)
    optional: dict[str, Shape] = field(default_factory=dict)

    def update(self, other: "Manifest") -> "Manifest":
        self.required.update(other.required)
        self.optional.update(other.optional)
        return self

    def names(self) -> set[str]:
        return set(self.required) | set(self.optional)

    def under(self, prefix: str) -> "Manifest":
        """The entries whose names start with ``prefix``, named relative to it."""
        cut = len(prefix)
        return Manifest(
            {n[cut:]: s for n, s in self.required.items() if n.startswith(prefix)},
            {n[cut:]: s for n, s in self.optional.items() if n.startswith(prefix)},
        )


class ArchFamily(Protocol):
    """What formats asks of an architecture family (``cortiq_engine.models.base.Family``)."""

    name: str
    activations: tuple[str, ...]  # gated-MLP activations the family's blocks compute
    mtp_style: str | None  # its draft layers' style, or None: the checkpoint's naming scheme says
    sanitize: SanitizeRules

    @property
    def model_types(self) -> tuple[str, ...]: ...

    def parse(self, config: Mapping[str, Any]) -> ArchConfig: ...

    def rules_for(self, config: Mapping[str, Any]) -> SanitizeRules: ...

    def mtp_name(self, name: str, config: Mapping[str, Any]) -> tuple[str | None, bool]: ...

    def draft_style(self, sources: Iterable[str]) -> str: ...

    def manifest(self, arch: ArchConfig, mtp_layers: Sequence[int] = ()) -> Manifest: ...


class Families(Protocol):
    """The registry of families: by a config.json's ``model_type`` or a header's ``arch``.
    Both raise one ``CortiqError`` line naming what is supported."""

    def for_model_type(self, model_type: Any) -> ArchFamily: ...

    def for_arch(self, arch: Any) -> ArchFamily: ...

    def for_gguf_arch(self, arch: Any) -> tuple[ArchFamily, GgufSpec]: ...


def check_manifest(
    manifest: Manifest,
    have: Mapping[str, Sequence[int]],
    *,
    holder: str = "checkpoint",
    implied_by: str = "config.json",
    trunk: bool = True,
) -> None:
    """Every required tensor is in ``have`` with its shape, and every optional one that is
    there has its shape. The one shape check: on a checkpoint at convert time, on a CMF
    file (or only the draft layers of a sidecar, ``trunk=False``) at load time."""
    for name, shape in manifest.required.items():
        if not trunk and not name.startswith(MTP_PREFIX):
            continue
        if name not in have:
            raise CortiqError(f"{holder} is missing tensor {name}")
        _check_shape(name, have[name], shape, implied_by)
    for name, shape in manifest.optional.items():
        if name in have and (trunk or name.startswith(MTP_PREFIX)):
            _check_shape(name, have[name], shape, implied_by)


def _check_shape(name: str, got: Sequence[int], want: Shape, implied_by: str) -> None:
    got = tuple(got)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        shown = ["*" if w is None else w for w in want]
        raise CortiqError(f"tensor {name} has shape {list(got)}, {implied_by} implies {shown}".replace("'*'", "*"))


def mtp_layer_indices(names: Iterable[str]) -> list[int]:
    """The draft-layer indices present among tensor ``names`` (normalized names)."""
    pat = re.compile(re.escape(MTP_PREFIX) + r"(\d+)\.")
    return sorted({int(m.group(1)) for n in names if (m := pat.match(n))})
