"""Checkpoint names -> the names the engine reads, applied as a streaming view.

``sanitize_checkpoint(ck, rules)`` returns a view of an ``HFCheckpoint`` whose
tensor names follow one convention. The *rules* belong to the architecture family
(``Family.sanitize`` in ``cortiq_engine/models/<family>.py``: regex renames such as
``block_sparse_moe.*.w1/w2/w3`` -> ``mlp.experts.*``); this module
only applies them, together with what every family shares:

- multimodal wrappers' ``model.language_model.*`` become ``model.*`` and their vision
  tower is dropped (``formats.checkpoint`` unwraps their ``text_config`` for every
  family alike);
- ``rules.split_fused_experts``: fused 3-D experts (``mlp.experts.gate_up_proj``
  [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], the layout transformers 5
  keeps in memory) are split into per-expert 2-D
  ``mlp.experts.E.{gate,up,down}_proj.weight``;
- ``rules.squeeze_conv``: Gated DeltaNet's depthwise ``conv1d.weight`` [C, 1, K]
  becomes [C, K];
- ``rules.split_rows``: a fused 2-D tensor is split by rows into named parts
  (``self_attn.qkv_proj`` into q/k/v, ``mlp.gate_up_proj`` into gate/up); the row
  counts come from config.json, so such rules are built per checkpoint
  (``Family.sanitize_for``).

Split and reshaped tensors are read straight from the source's memory map, a row
range at a time; nothing is copied up front.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Iterator

import numpy as np

from formats.errors import CortiqError
from formats import mxfp4
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
    # (regex, ((replacement, rows), ...)): a 2-D tensor whose name (after the renames)
    # fully matches is split into those parts, top rows first; the counts must add up.
    split_rows: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    # Fused experts [E, in, 2 * out] with gate/up interleaved along the last dim,
    # per-expert biases, and MXFP4 ``*_blocks`` / ``*_scales`` (``InterleavedExperts``).
    interleaved_experts: bool = False


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


def split_fused_rows(name: str, source: str, shape: tuple[int, ...], rules: SanitizeRules) -> dict[str, _Slice]:
    """Row ranges of ``source`` (named ``name`` after the renames) for the first
    ``rules.split_rows`` rule that matches it; empty when none does."""
    for pat, parts in rules.split_rows:
        m = re.fullmatch(pat, name)
        if m is None:
            continue
        want = [int(r) for _, r in parts]
        if len(shape) != 2 or shape[0] != sum(want) or min(want) < 1:
            raise CortiqError(
                f"tensor {source} has shape {list(shape)}: expected [{' + '.join(map(str, want))}, columns] "
                f"(fused {', '.join(m.expand(r) for r, _ in parts)})"
            )
        out, r0 = {}, 0
        for (replacement, _), rows in zip(parts, want):
            out[m.expand(replacement)] = _Slice(source, r0, r0 + rows, (rows, shape[1]))
            r0 += rows
        return out
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
                parts = split_fused_rows(new, src, shape, rules) if rules.split_rows else {}
            if not parts:
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

    def _whole(self, name: str) -> bool:
        sl = self._map[name]
        return sl.r0 == 0 and tuple(self._ck.shape(sl.source)) == sl.shape

    def _mapped(self) -> bool:
        """Whether the source exposes its stored rows (safetensors); a GGUF checkpoint
        dequantizes as it reads, so its slices are cut from its own row stream."""
        return hasattr(self._ck, "raw")

    def _cut_rows(self, name: str, max_elems: int) -> Iterator[np.ndarray]:
        """The slice's f32 rows from the source's row stream (which stops past them)."""
        sl, r = self._map[name], 0
        for block in self._ck.iter_f32_rows(sl.source, max_elems):
            lo, hi = max(sl.r0 - r, 0), min(sl.r1 - r, block.shape[0])
            if lo < hi:
                yield block[lo:hi]
            r += block.shape[0]
            if r >= sl.r1:
                return

    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        sl = self._map[name]
        if self._whole(name):
            yield from self._ck.iter_f32_rows(sl.source, max_elems)  # untouched: the reader's own streaming
            return
        if not self._mapped():
            yield from self._cut_rows(name, max_elems)
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
        shape = self._map[name].shape
        if not self._mapped():
            if self._whole(name):
                return self._ck.tensor(self._map[name].source).reshape(shape)
            return np.concatenate(list(self._cut_rows(name, 1 << 20))).reshape(shape)
        return self._f32(np.ascontiguousarray(self._rows(name)), name).reshape(shape)

    def sample_f32(self, name: str, count: int = 64) -> np.ndarray:
        if not self._mapped():
            return self._sample_stream(name, count)
        flat = self._rows(name).reshape(-1)
        if flat.size == 0:
            return np.zeros(0, np.float32)
        idx = np.linspace(0, flat.size - 1, num=min(count, flat.size)).astype(np.int64)
        return self._f32(flat[idx], name)

    def _sample_stream(self, name: str, count: int) -> np.ndarray:
        """The elements ``sample_f32`` picks, gathered from the row stream block by block."""
        if self._whole(name):
            return self._ck.sample_f32(self._map[name].source, count)
        rows, cols = rows_cols(self._map[name].shape)
        if rows * cols == 0:
            return np.zeros(0, np.float32)
        idx = np.linspace(0, rows * cols - 1, num=min(count, rows * cols)).astype(np.int64)
        out, r = np.empty(idx.size, np.float32), 0
        for block in self._cut_rows(name, 1 << 20):
            sel = (idx // cols >= r) & (idx // cols < r + block.shape[0])
            out[sel] = block[idx[sel] // cols - r, idx[sel] % cols]
            r += block.shape[0]
        return out


def sanitize_checkpoint(ck: Any, rules: SanitizeRules = NO_RULES) -> Any:
    """``ck`` under the engine's tensor names (``rules``: the family's); ``ck`` itself
    when nothing needs renaming."""
    view = (InterleavedExperts if rules.interleaved_experts else SanitizedCheckpoint)(ck, rules)
    if all(view.source_of(n) == n and tuple(ck.shape(n)) == view.shape(n) for n in view.names()) and len(
        view.names()
    ) == len(ck.names()):
        return ck
    return view


class _ShapesOnly:
    """A checkpoint of names and shapes only, for checking a plan before reading data."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self._shapes = shapes
        self.root = "checkpoint"

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]


def sanitized_shapes(shapes: dict[str, tuple[int, ...]], rules: SanitizeRules = NO_RULES) -> dict[str, tuple[int, ...]]:
    """The engine's names and shapes for checkpoint tensors ``shapes`` under ``rules``."""
    view = SanitizedCheckpoint(_ShapesOnly(dict(shapes)), rules)
    return {n: tuple(view.shape(n)) for n in view.names()}


# ------------------------------------------------------------------ interleaved fused experts
# A fused projection's parts: (name, first row, row step); gate_up interleaves its halves.
_EXPERT_PARTS = {"gate_up_proj": (("gate_proj", 0, 2), ("up_proj", 1, 2)), "down_proj": (("down_proj", 0, 1),)}
_INTERLEAVED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@dataclass(frozen=True)
class _View:
    """A virtual 1-D or 2-D tensor computed from source tensors a row range at a time:
    ``read(r0, r1)`` is rows r0..r1 as f32 [r1 - r0, cols] (a 1-D tensor is one row)."""

    source: str
    shape: tuple[int, ...]
    dtype: str
    read: Any


class InterleavedExperts(SanitizedCheckpoint):
    """Interleaved fused experts as the engine's per-expert ``mlp.experts.E.{gate,up,down}_proj``
    weights [out, in] and biases, computed per expert and row range, never a whole stack:

    - ``gate_up_proj`` [E, H, 2I]: gate = columns 0::2, up = columns 1::2, transposed;
      ``down_proj`` [E, I, H] transposed; ``gate_up_proj_bias`` [E, 2I] split the same way,
      ``down_proj_bias`` [E, H] per expert;
    - MXFP4 (the release): ``gate_up_proj_blocks`` [E, 2I, H/32, 16] with
      ``gate_up_proj_scales`` [E, 2I, H/32] (rows already [out, in], gate = rows 0::2),
      ``down_proj_blocks`` [E, H, I/32, 16] with ``down_proj_scales``, decoded by
      ``formats.mxfp4``. Decoded values are exact in bfloat16, which is what they report.
    """

    def __init__(self, ck: Any, rules: SanitizeRules = NO_RULES):
        super().__init__(ck, rules)
        groups: dict[str, dict[str, str]] = {}
        for new in list(self._map):
            m = _INTERLEAVED.match(new)
            if m and len(self._map[new].shape) in (2, 3, 4):
                groups.setdefault(m.group(1), {})[m.group(2) + (m.group(3) or "")] = self._map.pop(new).source
        self._views: dict[str, _View] = {}
        for base, parts in groups.items():
            for new, view in self._expert_views(base, parts).items():
                if new in self._map or new in self._views:
                    raise CortiqError(f"checkpoint tensor {view.source} and another both map to {new}")
                self._views[new] = view

    # --------------------------------------------------------------- building the views
    def _src_f32(self, src: str, a: np.ndarray) -> np.ndarray:
        if self._ck.source_dtype(src) == "BF16":
            return bf16_to_f32(a)
        return np.asarray(a).astype(np.float32, copy=False)

    def _expert_views(self, base: str, parts: dict[str, str]) -> dict[str, _View]:
        ck, out = self._ck, {}
        for proj in ("gate_up_proj", "down_proj"):
            plain, blocks, scales = parts.get(proj), parts.get(proj + "_blocks"), parts.get(proj + "_scales")
            if plain is not None and (blocks or scales):
                raise CortiqError(f"checkpoint has both {plain} and its MXFP4 blocks")
            if (blocks is None) != (scales is None):
                have = blocks or scales
                raise CortiqError(f"MXFP4 tensor {have} has no {'scales' if blocks else 'blocks'} beside it")
            if plain is not None:
                shape = tuple(int(d) for d in ck.shape(plain))
                if len(shape) != 3:
                    raise CortiqError(
                        f"tensor {plain} has shape {list(shape)}: expected 3 dimensions [experts, in, out]"
                    )
                e, inner, outer = shape  # [E, in, out]: row r of the engine's weight is column r
                if proj == "gate_up_proj" and outer % 2:
                    raise CortiqError(
                        f"tensor {plain} has shape {list(shape)}: expected [experts, hidden, 2 * intermediate]"
                    )
                out.update(
                    self._split(
                        base, proj, plain, self._source_dtype(plain), e, (outer, inner), partial(self._columns, plain)
                    )
                )
            elif blocks is not None:
                bshape = tuple(int(d) for d in ck.shape(blocks))
                sshape = tuple(int(d) for d in ck.shape(scales))
                shape = mxfp4.check_pair(
                    blocks, bshape, ck.source_dtype(blocks), scales, sshape, ck.source_dtype(scales)
                )
                if len(shape) != 3:
                    raise CortiqError(
                        f"MXFP4 tensor {blocks} has shape {list(bshape)}: expected [experts, out, groups, 16]"
                    )
                e, rows, cols = shape
                if proj == "gate_up_proj" and rows % 2:
                    raise CortiqError(f"MXFP4 tensor {blocks} has {rows} rows per expert: expected 2 * intermediate")
                out.update(
                    self._split(base, proj, blocks, "BF16", e, (rows, cols), partial(self._mxfp4_rows, blocks, scales))
                )
            bias = parts.get(proj + "_bias")
            if bias is not None:
                shape = tuple(int(d) for d in ck.shape(bias))
                if len(shape) != 2 or (proj == "gate_up_proj" and shape[1] % 2):
                    width = "2 * intermediate" if proj == "gate_up_proj" else "hidden"
                    raise CortiqError(f"tensor {bias} has shape {list(shape)}: expected [experts, {width}]")
                for k in range(shape[0]):
                    for name, half, step in _EXPERT_PARTS[proj]:
                        out[f"{base}.{k}.{name}.bias"] = _View(
                            bias, (shape[1] // step,), self._source_dtype(bias), self._bias(bias, k, half, step)
                        )
        return out

    @staticmethod
    def _split(
        base: str, proj: str, src: str, dtype: str, experts: int, shape: tuple[int, int], reader
    ) -> dict[str, _View]:
        """Each expert's weight views of one fused projection: ``reader(k, first, step)``
        reads rows first + step * r of expert k, [rows, cols] = ``shape`` before the split."""
        rows, cols = shape
        return {
            f"{base}.{k}.{name}.weight": _View(src, (rows // step, cols), dtype, reader(k, first, step))
            for k in range(experts)
            for name, first, step in _EXPERT_PARTS[proj]
        }

    def _source_dtype(self, src: str) -> str:
        return self._ck.source_dtype(src)

    def _columns(self, src: str, k: int, first: int, step: int):
        """Rows r0..r1 of expert ``k``'s weight: source columns first + step * r, transposed."""

        def read(r0: int, r1: int) -> np.ndarray:
            a = self._ck.raw(src)[k][:, first + step * r0 : first + step * r1 : step]
            return np.ascontiguousarray(self._src_f32(src, a).T)

        return read

    def _mxfp4_rows(self, blocks: str, scales: str, k: int, first: int, step: int):
        """Rows r0..r1 of expert ``k``'s weight: decoded block rows first + step * r."""

        def read(r0: int, r1: int) -> np.ndarray:
            sl = slice(first + step * r0, first + step * r1, step)
            return mxfp4.decode(self._ck.raw(blocks)[k, sl], self._ck.raw(scales)[k, sl], blocks)

        return read

    def _bias(self, src: str, k: int, first: int, step: int):
        def read(r0: int, r1: int) -> np.ndarray:
            return self._src_f32(src, self._ck.raw(src)[k, first::step]).reshape(1, -1)

        return read

    # --------------------------------------------------------------- the checkpoint reads
    def names(self) -> list[str]:
        return [*self._map, *self._views]

    def source_of(self, name: str) -> str:
        return self._views[name].source if name in self._views else super().source_of(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._views[name].shape if name in self._views else super().shape(name)

    def source_dtype(self, name: str) -> str:
        return self._views[name].dtype if name in self._views else super().source_dtype(name)

    def iter_f32_rows(self, name: str, max_elems: int = 1 << 20) -> Iterator[np.ndarray]:
        if name not in self._views:
            yield from super().iter_f32_rows(name, max_elems)
            return
        v = self._views[name]
        rows, cols = rows_cols(v.shape)
        step = max(1, max_elems // max(cols, 1))
        for r0 in range(0, rows, step):
            yield v.read(r0, min(rows, r0 + step))
        # The expert's source pages are read across a whole stack's rows: hand them back.
        self._ck.release_pages()

    def tensor(self, name: str) -> np.ndarray:
        if name not in self._views:
            return super().tensor(name)
        v = self._views[name]
        return np.concatenate(list(self.iter_f32_rows(name)), axis=0).reshape(v.shape)

    def sample_f32(self, name: str, count: int = 64) -> np.ndarray:
        if name not in self._views:
            return super().sample_f32(name, count)
        v = self._views[name]
        rows, cols = rows_cols(v.shape)
        flat = np.linspace(0, rows * cols - 1, num=min(count, rows * cols)).astype(np.int64)
        vals = np.empty(flat.size, np.float32)
        for r in np.unique(flat // cols):  # evenly spaced elements, one row read per row touched
            sel = flat // cols == r
            vals[sel] = v.read(int(r), int(r) + 1)[0, flat[sel] % cols]
        return vals
