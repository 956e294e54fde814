"""``convert_checkpoint`` with the engine's architecture families.

``formats.convert`` knows bytes and takes the families as an argument (formats
does not import the engine); this is the one place that passes them in. The CLI
and the tests convert through here.
"""

from __future__ import annotations

from pathlib import Path

from formats.convert import ConvertReport
from formats.convert import convert_checkpoint as _convert_checkpoint
from formats.gguf_import import GgufModel, ImportReport
from formats.gguf_import import import_gguf as _import_gguf
from formats.gguf_import import read_gguf as _read_gguf
from cortiq_engine.models import FAMILIES


def convert_checkpoint(src: str | Path, out: str | Path, **options) -> ConvertReport:
    """Convert an HF checkpoint folder, a hub repo id, a .gguf or a .cmf file into ``out``;
    ``options`` (quant, keep, mtp, force, progress, imatrix, ...) are
    ``formats.convert.convert_checkpoint``'s."""
    return _convert_checkpoint(src, out, families=FAMILIES, **options)


def read_gguf(path: str | Path) -> GgufModel:
    """Parse and validate a GGUF against the families (``formats.gguf_import.read_gguf``)."""
    return _read_gguf(path, FAMILIES)


def import_gguf(src: str | Path, out_dir: str | Path, **kw) -> ImportReport:
    """A GGUF -> an HF checkpoint folder (``formats.gguf_import.import_gguf``)."""
    return _import_gguf(src, out_dir, families=FAMILIES, **kw)


def gguf_architectures() -> list[str]:
    """The llama.cpp architectures the families import."""
    return sorted(FAMILIES.by_gguf)
