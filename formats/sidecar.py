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
from formats.mtp_names import MTP_PREFIX
from formats.untrusted_json import section

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


def count_mtp_layers(cmf) -> int:
    """Draft layers in a CMF file: consecutive ``model.mtp.layers.{k}`` from 0."""
    k = 0
    while f"{MTP_PREFIX}{k}.eh_proj.weight" in cmf:
        k += 1
    return k


def open_sidecar(main_path: str | Path, main_header: dict[str, Any], path: str | Path | None = None):
    """The one sidecar opener: the validated sidecar as a ``CmfFile``, from ``path`` when
    given (it must exist), else ``<stem>.mtp.cmf`` beside ``main_path`` (None when there
    is none). Valid: cut from this backbone, and holding the draft layers both headers
    declare; else a ``CortiqError`` naming the file."""
    from formats.cmf import CmfFile

    side = Path(path) if path is not None else sidecar_path(main_path)
    if not side.is_file():
        if path is None:
            return None
        raise CortiqError(f"MTP sidecar {side}: no such file")
    cmf = CmfFile(side)
    try:
        check_sidecar(main_header, cmf.header)
        declared = section(cmf.header, "mtp").get("num_layers")
        have = count_mtp_layers(cmf)
        if not have:
            raise CortiqError(f"it holds no draft layers (no {MTP_PREFIX}0.eh_proj.weight)")
        if declared is not None and declared != have:
            raise CortiqError(f"MTP layer count {declared} in its header, {have} layers of tensors")
        backbone_mtp = section(main_header, "mtp")
        if backbone_mtp.get("location") == "sidecar" and backbone_mtp.get("num_layers") not in (None, have):
            raise CortiqError(f"MTP layer count {backbone_mtp['num_layers']} in the backbone, {have} in the sidecar")
    except CortiqError as e:
        cmf.close()
        raise CortiqError(f"MTP sidecar {side}: {e}") from None
    return cmf
