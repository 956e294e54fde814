"""The MTP sidecar: draft layers kept beside their backbone in ``OUT.mtp.cmf``.

A sidecar is only meaningful next to the exact backbone it was cut from, so its
header (``role: "mtp_sidecar"``) carries a ``backbone`` record: the backbone's
geometry and its fingerprint. ``check_sidecar`` compares that record with a
backbone's header and names every difference.

A sidecar may also carry a *draft vocabulary* (``DRAFT_VOCAB_TENSOR``, i32 [N], token
ids most useful first, with the header record ``mtp.draft_vocab``): the drafts score
only those rows of the backbone's lm_head. ``read_draft_vocab`` validates it;
``copy_with_draft_vocab`` writes a sidecar's tensors byte for byte with a new one.

A sidecar may also carry *measured defaults* (header record ``mtp.defaults``: the
depth and adaptive-depth threshold that ``cortiq mtp-train`` (on the live rounds of its
held-out greedy windows) or ``cortiq mtp-probe --choose-threshold --save`` found fastest
on this machine); ``read_defaults`` validates them and
``generate`` drafts so unless told otherwise. Its optional ``with_lookup`` record holds
the depth and threshold measured fastest when n-gram lookup drafts first
(``cortiq_engine.lookup``; ``read_lookup_defaults``).

A sidecar ``cortiq mtp-train`` wrote also records its held-out acceptance per depth
(``trained.held_out.acceptance_per_depth``): ``read_held_out`` validates it, and the
engine models from it whether the layers are worth a first round at all.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import CortiqError
from formats.mtp_names import MTP_PREFIX
from formats.untrusted_json import is_int, section

ROLE_MODEL = "model"
ROLE_SIDECAR = "mtp_sidecar"
DRAFT_VOCAB_TENSOR = "mtp.draft_vocab"
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
        read_draft_vocab(cmf, _get(main_header, ("arch", "vocab_size")))
        read_defaults(cmf.header, have)
        read_lookup_defaults(cmf.header, have)
        read_held_out(cmf.header)
    except CortiqError as e:
        cmf.close()
        raise CortiqError(f"MTP sidecar {side}: {e}") from None
    return cmf


def read_defaults(header: dict[str, Any], num_layers: int) -> tuple[int | None, float | None]:
    """The sidecar's measured (depth, threshold), (None, None) without a record. Valid: an
    object whose ``depth`` is an integer in 1..num_layers and ``threshold`` a number in
    [0, 1); else a one-line ``CortiqError``."""
    rec = section(header, "mtp").get("defaults")
    if rec is None:
        return None, None
    if not isinstance(rec, dict):
        raise CortiqError(f"MTP defaults: header record mtp.defaults is {type(rec).__name__}, expected an object")
    depth, threshold = rec.get("depth"), rec.get("threshold")
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= num_layers:
        raise CortiqError(f"MTP defaults: depth {depth!r} is not between 1 and the {num_layers} draft layer(s)")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= float(threshold) < 1.0:
        raise CortiqError(f"MTP defaults: threshold {threshold!r} is not a number in [0, 1)")
    return depth, float(threshold)


MAX_HELD_OUT_DEPTH = 64


def read_held_out(header: dict[str, Any]) -> tuple[float, ...] | None:
    """The held-out acceptance per depth ``cortiq mtp-train`` measured, None without a
    record. Valid: a list of 1..MAX_HELD_OUT_DEPTH numbers in [0, 1] (a recursive chain
    drafts deeper than its layers); else a one-line ``CortiqError``."""
    trained = section(header, "trained")
    held = trained.get("held_out")
    if held is None:
        return None
    if not isinstance(held, dict):
        raise CortiqError(f"trained.held_out is {type(held).__name__}, expected an object")
    acc = held.get("acceptance_per_depth")
    if acc is None:
        return None
    if (
        not isinstance(acc, list)
        or not 1 <= len(acc) <= MAX_HELD_OUT_DEPTH
        or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= a <= 1.0 for a in acc)
    ):
        raise CortiqError(
            f"trained.held_out.acceptance_per_depth is not a list of 1..{MAX_HELD_OUT_DEPTH} numbers in [0, 1]"
        )
    return tuple(float(a) for a in acc)


# Bounds of the lookup settings a record may name (cortiq_engine.lookup validates the same).
MAX_LOOKUP_DRAFTS = 64
MAX_LOOKUP_NGRAM = 16


@dataclass(frozen=True)
class LookupDefaults:
    """The MTP depth and threshold measured fastest when n-gram lookup (``lookup``
    drafts, matches of ``ngram`` = (min, max) tokens) drafts first each round."""

    lookup: int
    ngram: tuple[int, int]
    depth: int
    threshold: float


def read_lookup_defaults(header: dict[str, Any], num_layers: int) -> LookupDefaults | None:
    """The sidecar's ``mtp.defaults.with_lookup`` record, None without one; a malformed
    one is a one-line ``CortiqError`` (as ``read_defaults``)."""
    rec = section(header, "mtp").get("defaults")
    if not isinstance(rec, dict) or rec.get("with_lookup") is None:
        return None
    sub = rec["with_lookup"]
    if not isinstance(sub, dict):
        raise CortiqError(f"MTP defaults: with_lookup is {type(sub).__name__}, expected an object")
    lookup, ngram = sub.get("lookup"), sub.get("ngram")
    if not is_int(lookup) or not 1 <= lookup <= MAX_LOOKUP_DRAFTS:
        raise CortiqError(f"MTP defaults: with_lookup.lookup {lookup!r} is not an integer in 1..{MAX_LOOKUP_DRAFTS}")
    if (
        not isinstance(ngram, list)
        or len(ngram) != 2
        or not all(is_int(x) for x in ngram)
        or not 1 <= ngram[0] <= ngram[1] <= MAX_LOOKUP_NGRAM
    ):
        raise CortiqError(
            f"MTP defaults: with_lookup.ngram {ngram!r} is not [min, max] with 1 <= min <= max <= {MAX_LOOKUP_NGRAM}"
        )
    try:
        depth, threshold = read_defaults({"mtp": {"defaults": sub}}, num_layers)
    except CortiqError as e:
        raise CortiqError(str(e).replace("MTP defaults: ", "MTP defaults: with_lookup.", 1)) from None
    return LookupDefaults(int(lookup), (int(ngram[0]), int(ngram[1])), int(depth), float(threshold))


def write_defaults(path: str | Path, record: dict[str, Any]) -> Path:
    """Record measured defaults (``depth``, ``threshold`` and how they were measured) in
    the sidecar at ``path``, rewriting it in place (staged, then renamed over)."""
    from formats.cmf import CmfFile

    with CmfFile(path) as cmf:
        backbone = cmf.header.get("backbone")
        ids = read_draft_vocab(cmf, backbone.get("vocab_size") if isinstance(backbone, dict) else None)
        vrec = section(cmf.header, "mtp").get("draft_vocab")
    return copy_with_draft_vocab(path, path, ids, vrec, force=True, defaults=record)


def read_draft_vocab(cmf, vocab_size: Any) -> np.ndarray | None:
    """The draft vocabulary of a sidecar (int64 ids, most useful first), None when it has
    none. Valid: the header record and the tensor both present or both absent, i32 [N]
    with N the record's ``size``, 1 <= N <= vocab_size, every id in range, no repeats;
    else a one-line ``CortiqError``."""
    rec = section(cmf.header, "mtp").get("draft_vocab")
    has = DRAFT_VOCAB_TENSOR in cmf
    if rec is None and not has:
        return None
    if rec is None or not has:
        missing = "header record mtp.draft_vocab" if rec is None else f"tensor {DRAFT_VOCAB_TENSOR}"
        raise CortiqError(f"draft vocabulary: the {missing} is missing")
    if not isinstance(rec, dict):
        raise CortiqError(
            f"draft vocabulary: header record mtp.draft_vocab is {type(rec).__name__}, expected an object"
        )
    size = rec.get("size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise CortiqError(f"draft vocabulary: the backbone's vocab size {vocab_size!r} is not a positive integer")
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= vocab_size:
        raise CortiqError(f"draft vocabulary: size {size!r} is not between 1 and the vocab size {vocab_size}")
    info = cmf.info(DRAFT_VOCAB_TENSOR)
    if info.dtype != "i32" or tuple(info.shape) != (size,):
        raise CortiqError(f"draft vocabulary: tensor is {info.dtype}{list(info.shape)}, expected i32[{size}]")
    ids = cmf.tensor_parts(DRAFT_VOCAB_TENSOR)["data"].astype(np.int64)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise CortiqError(f"draft vocabulary: token id {int(bad[0])} outside the vocabulary 0..{vocab_size - 1}")
    if np.unique(ids).size != ids.size:
        s = np.sort(ids)
        raise CortiqError(f"draft vocabulary: token id {int(s[1:][s[1:] == s[:-1]][0])} appears twice")
    return ids


def draft_vocab_record(ids: np.ndarray, source: str, tokens: int) -> dict[str, Any]:
    """The header record ``mtp.draft_vocab`` of a vocabulary chosen from ``tokens`` tokens of ``source``."""
    return {
        "size": int(len(ids)),
        "tensor": DRAFT_VOCAB_TENSOR,
        "order": "most useful first",
        "text": source,
        "tokens": int(tokens),
    }


def copy_with_draft_vocab(
    src: str | Path,
    out: str | Path,
    ids: np.ndarray | None,
    record: dict[str, Any] | None,
    *,
    force: bool = False,
    defaults: dict[str, Any] | None = None,
) -> Path:
    """Write sidecar ``src`` to ``out`` with the draft vocabulary ``ids`` (None: without
    one); every other tensor is copied byte for byte, the header keeps all else. ``out``
    may be ``src`` (with ``force``): the writer stages a new file and renames it over.
    ``defaults``: a new ``mtp.defaults`` record (measured defaults keep only with the
    vocabulary they were measured with: a new vocabulary drops them)."""
    from formats.cmf import CmfFile, CmfWriter

    out = Path(out)
    if out.exists() and not force:
        raise CortiqError(f"{out} exists (use --force to overwrite)")
    with CmfFile(src) as cmf:
        if cmf.header.get("role") != ROLE_SIDECAR:
            raise CortiqError(f"{src}: not an MTP sidecar (role {cmf.header.get('role')!r})")
        header = copy.deepcopy(cmf.header)
        mtp = header.get("mtp") if isinstance(header.get("mtp"), dict) else {}
        if mtp.pop("draft_vocab", None) != record:
            mtp.pop("defaults", None)
        if ids is not None:
            mtp["draft_vocab"] = record
        if defaults is not None:
            mtp["defaults"] = defaults
        header["mtp"] = mtp
        with CmfWriter(out, header, force=True) as w:
            for name in cmf.names():
                if name == DRAFT_VOCAB_TENSOR:
                    continue
                info = cmf.info(name)
                w.add_encoded(name, info.dtype, tuple(info.shape), list(cmf.tensor_parts(name).values()))
            if ids is not None:
                w.add(DRAFT_VOCAB_TENSOR, "i32", np.asarray(ids, dtype=np.int64))
    return out
