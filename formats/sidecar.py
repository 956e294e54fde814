"""The MTP sidecar: draft layers kept beside their backbone in ``OUT.mtp.cmf``.

A sidecar is only meaningful next to the exact backbone it was cut from, so its
header (``role: "mtp_sidecar"``) carries a ``backbone`` record: the backbone's
geometry and its fingerprint. ``check_sidecar`` compares that record with a
backbone's header and names every difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from formats.errors import CortiqError

ROLE_MODEL = "model"
ROLE_SIDECAR = "mtp_sidecar"
# backbone key -> (label in messages, where the value sits in a model header)
_GEOMETRY = {
    "arch": ("arch", ("arch", "arch")),
    "hidden_size": ("hidden size", ("arch", "hidden_size")),
    "vocab_size": ("vocab size", ("arch", "vocab_size")),
    "num_layers": ("layer count", ("arch", "num_layers")),
    "num_heads": ("heads", ("arch", "num_heads")),
    "num_kv_heads": ("KV heads", ("arch", "num_kv_heads")),
    "head_dim": ("head dim", ("arch", "head_dim")),
    "fingerprint": ("fingerprint", ("source", "fingerprint")),
}


def sidecar_path(out: str | Path) -> Path:
    """``model.cmf`` -> ``model.mtp.cmf`` (a name without .cmf gets ``.mtp.cmf`` appended)."""
    out = Path(out)
    stem = out.name[: -len(".cmf")] if out.name.endswith(".cmf") else out.name
    return out.with_name(f"{stem}.mtp.cmf")


def _get(header: dict[str, Any], path: tuple[str, str]) -> Any:
    section = header.get(path[0])
    return section.get(path[1]) if isinstance(section, dict) else None


def backbone_identity(main_header: dict[str, Any], main_name: str) -> dict[str, Any]:
    """The ``backbone`` record a sidecar stores, taken from its backbone's header."""
    ident: dict[str, Any] = {"file": main_name}
    for key, (_, where) in _GEOMETRY.items():
        ident[key] = _get(main_header, where)
    return ident


def check_sidecar(main_header: dict[str, Any], sidecar_header: dict[str, Any]) -> None:
    """Raise ``CortiqError`` unless the sidecar was cut from this backbone.

    The message names each field that differs (arch, hidden size, vocab size,
    layer count, heads, KV heads, head dim, fingerprint).
    """
    role = sidecar_header.get("role")
    if role != ROLE_SIDECAR:
        raise CortiqError(f"not an MTP sidecar (role {role!r}, expected {ROLE_SIDECAR!r})")
    if main_header.get("role", ROLE_MODEL) != ROLE_MODEL:
        raise CortiqError(f"the backbone is not a model file (role {main_header.get('role')!r})")
    backbone = sidecar_header.get("backbone")
    if not isinstance(backbone, dict):
        raise CortiqError("MTP sidecar has no backbone record in its header")
    diffs = []
    for key, (label, where) in _GEOMETRY.items():
        want, have = backbone.get(key), _get(main_header, where)
        if want != have:
            diffs.append(f"{label} {have} in the backbone, {want} in the sidecar")
    if diffs:
        raise CortiqError("MTP sidecar does not match its backbone: " + "; ".join(diffs))


def open_sidecar(main_path: str | Path, main_header: dict[str, Any]):
    """The validated sidecar beside ``main_path`` as a ``CmfFile``, or None if there is none."""
    from formats.cmf import CmfFile

    path = sidecar_path(main_path)
    if not path.is_file():
        return None
    side = CmfFile(path)
    try:
        check_sidecar(main_header, side.header)
    except CortiqError as e:
        side.close()
        raise CortiqError(f"{path}: {e}") from None
    return side
