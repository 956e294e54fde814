"""Checkpoint names -> the names the engine reads, applied as a streaming view.

``sanitize_checkpoint(ck, rules)`` returns a view of an ``HFCheckpoint`` whose
tensor names follow one convention. The *rules* belong to the architecture family
(``Family.sanitize`` in ``cortiq_engine/models/<family>.py``: Mixtral's
``block_sparse_moe.*.w1/w2/w3``, MiMo-V2's ``attention_sink_bias``...); this module
only applies them, together with what every family shares:

- multimodal wrappers' ``model.language_model.*`` become ``model.*`` and their vision
  tower is dropped (``formats.checkpoint`` unwraps their ``text_config`` for every
  family alike);
- ``rules.split_fused_experts``: fused 3-D experts (``mlp.experts.gate_up_proj``
  [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], the layout transformers 5
  keeps in memory) are split into per-expert 2-D
  ``mlp.experts.E.{gate,up,down}_proj.weight``;
- ``rules.squeeze_conv``: Gated DeltaNet's depthwise ``conv1d.weight`` [C, 1, K]
  becomes [C, K].

Split and reshaped tensors are read straight from the source's memory map, a row
range at a time; nothing is copied up front.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from formats.errors import CortiqError
from formats.quants import bf16_to_f32, rows_cols

# Every family: multimodal wrappers' text model prefix, and their non-LM parts dropped.
_WRAPPER = (re.compile(r"^model\.language_model\."), "model.")
_DROP = re.compile(r"^(model\.visual\.|visual\.|model\.vision_tower\.|vision_tower\.|model\.multi_modal_projector\.)")
_FUSED_GATE_UP = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj(\.weight)?$")
_FUSED_DOWN = re.compile(r"^(.*\.mlp\.experts)\.down_proj(\.weight)?$")
_CONV = re.compile(r"\.linear_attn\.conv1d\.weight$")


@dataclass(frozen=True)
class SanitizeRules:
    """A family's checkpoint-name rules (see the module doc)."""

    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement), applied in order
    split_fused_experts: bool = False
    squeeze_conv: bool = False


NO_RULES = SanitizeRules()


@lru_cache(maxsize=64)
def _compiled(rules: SanitizeRules) -> tuple[tuple[re.Pattern[str], str], ...]:
    return (_WRAPPER, *((re.compile(pat), rep) for pat, rep in rules.renames))


@dataclass(frozen=True)
class _Slice:
    """A virtual tensor: rows r0..r1 of ``source`` seen as a (rows, cols) matrix."""

    source: str
    r0: int
    r1: int
    shape: tuple[int, ...]


def rename(name: str, rules: SanitizeRules = NO_RULES) -> str | None:
    """The engine's name for a plain (unsplit) checkpoint tensor, or None to drop it."""
    if _DROP.match(name):
        return None
    for pat, rep in _compiled(rules):
        name = pat.sub(rep, name)
    return name


def split_fused_experts(name: str, shape: tuple[int, ...], rules: SanitizeRules = NO_RULES) -> dict[str, _Slice]:
    """Per-expert 2-D slices of a fused 3-D expert tensor (empty if ``name`` is not one)."""
    m = _FUSED_GATE_UP.match(name)
    if m and len(shape) == 3:
        e, two_i, h = shape
        if two_i % 2:
            raise CortiqError(f"tensor {name} has shape {list(shape)}: expected [experts, 2 * intermediate, hidden]")
        i = two_i // 2
        base = rename(m.group(1), rules)
        out = {}
        for k in range(e):
            out[f"{base}.{k}.gate_proj.weight"] = _Slice(name, k * two_i, k * two_i + i, (i, h))
            out[f"{base}.{k}.up_proj.weight"] = _Slice(name, k * two_i + i, (k + 1) * two_i, (i, h))
        return out
    m = _FUSED_DOWN.match(name)
    if m and len(shape) == 3:
        e, h, i = shape
        base = rename(m.group(1), rules)
        return {f"{base}.{k}.down_proj.weight": _Slice(name, k * h, (k + 1) * h, (h, i)) for k in range(e)}
    return {}


class SanitizedCheckpoint:
    """An ``HFCheckpoint`` seen under the engine's tensor names (see the module doc).

    It answers the reads the converter makes (names, shape, source_dtype,
    iter_f32_rows, sample_f32, tensor) and passes everything else through.
    """

    def __init__(self, ck: Any, rules: SanitizeRules = NO_RULES):
        self._ck = ck
        self._map: dict[str, _Slice] = {}
        for src in ck.names():
            shape = tuple(int(d) for d in ck.shape(src))
            parts = split_fused_experts(src, shape, rules) if rules.split_fused_experts else {}
            if not parts:
                new = rename(src, rules)
                if new is None:
                    continue
                if rules.squeeze_conv and _CONV.search(new) and len(shape) == 3 and shape[1] == 1:
                    shape = (shape[0], shape[2])
                parts = {new: _Slice(src, 0, rows_cols(shape)[0], shape)}
            for new, sl in parts.items():
                if new in self._map:
                    raise CortiqError(f"checkpoint tensors {self._map[new].source} and {sl.source} both map to {new}")
                self._map[new] = sl

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._ck, attr)

    def names(self) -> list[str]:
        return list(self._map)

    def source_of(self, name: str) -> str:
        return self._map[name].source

    def shape(self, name: str) -> tuple[int, ...]:
        return self._map[name].shape

    def source_dtype(self, name: str) -> str:
        return self._ck.source_dtype(self._map[name].source)

    def _rows(self, name: str) -> np.ndarray:
        """The tensor's rows in the source dtype, a view into the map."""
        sl = self._map[name]
        raw = self._ck.raw(sl.source)
        rows, cols = rows_cols(tuple(raw.shape))
        return raw.reshape(rows, cols)[sl.r0 : sl.r1]

    def _f32(self, a: np.ndarray, name: str) -> np.ndarray:
        if self.source_dtype(name) == "BF16":
            return bf16_to_f32(a)
        return a.astype(np.float32, copy=False)

    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        sl = self._map[name]
        if sl.r0 == 0 and tuple(self._ck.shape(sl.source)) == sl.shape:
            yield from self._ck.iter_f32_rows(sl.source, max_elems)  # untouched: the reader's own streaming
            return
        a = self._rows(name)
        rows, cols = rows_cols(sl.shape)
        a = a.reshape(rows, cols)
        step = max(1, max_elems // max(cols, 1))
        for r0 in range(0, rows, step):
            yield self._f32(a[r0 : r0 + step], name)

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._map:
            raise CortiqError(f"{self._ck.root}: missing tensor {name}")
        return self._f32(np.ascontiguousarray(self._rows(name)), name).reshape(self._map[name].shape)

    def sample_f32(self, name: str, count: int = 64) -> np.ndarray:
        flat = self._rows(name).reshape(-1)
        if flat.size == 0:
            return np.zeros(0, np.float32)
        idx = np.linspace(0, flat.size - 1, num=min(count, flat.size)).astype(np.int64)
        return self._f32(flat[idx], name)


def sanitize_checkpoint(ck: Any, rules: SanitizeRules = NO_RULES) -> Any:
    """``ck`` under the engine's tensor names (``rules``: the family's); ``ck`` itself
    when nothing needs renaming."""
    view = SanitizedCheckpoint(ck, rules)
    if all(view.source_of(n) == n and tuple(ck.shape(n)) == view.shape(n) for n in view.names()) and len(
        view.names()
    ) == len(ck.names()):
        return ck
    return view
