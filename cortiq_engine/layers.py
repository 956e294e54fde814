"""Shared building blocks of decoder layers: norms, rotary embeddings, attention,
MLP, and the pre-norm residual block. Architecture files (``models/``) assemble
them; a new kind of layer (MoE, linear attention, a rotating cache) is a new
class with the same call signature, not an edit here.

Every module computes on [n, hidden] f32 rows through a kernel set, so the same
code serves decode (n = 1), batched verification (small n) and prefill chunks.
Attention is one class with options (window, sinks, V scale, output gate, q/k norm,
partial rotary); linear attention (Gated DeltaNet) lives in ``gated_deltanet``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.cache import KVCache, kv_dtype
from cortiq_engine.kernels.reference import AttentionCall
from cortiq_engine.weights import Weight


# ------------------------------------------------------------------ per-forward context
@dataclass
class Step:
    """What every layer of one forward call shares: the absolute positions of the
    new tokens, and the rotary tables for them (computed once per RoPE, not per layer)."""

    positions: np.ndarray  # int64 [n]
    _tables: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # The sequence's context length (its cache capacity; 0: the positions' own extent):
    # length-dependent RoPE (longrope, dynamic) picks its frequencies from it, so every
    # token of a sequence is rotated alike however its forward calls are split.
    context: int = 0
    # The sequence's expert-choice counts (layer -> [experts]); MoE blocks add to it.
    expert_usage: dict[int, np.ndarray] | None = None

    @property
    def n(self) -> int:
        return int(self.positions.shape[0])

    def rope_tables(self, rope: "RoPE") -> tuple[np.ndarray, np.ndarray]:
        key = id(rope)
        if key not in self._tables:
            self._tables[key] = rope.tables(self.positions, self.context)
        return self._tables[key]


# ------------------------------------------------------------------ norms
class RMSNorm:
    """x / rms(x) * w. ``style="rms_one"`` (Qwen3-Next) scales by (1 + w)."""

    def __init__(self, kernels, weight: np.ndarray, eps: float, style: str = "rms"):
        self.ks = kernels
        self.weight = np.ascontiguousarray(weight + 1.0 if style == "rms_one" else weight, dtype=np.float32)
        if self.weight.ndim != 1:
            raise CortiqError(f"a norm weight must be a vector, got shape {list(self.weight.shape)}")
        self.eps = float(eps)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.ks.rms_norm(x, self.weight, self.eps)

    def add_then_norm(self, x: np.ndarray, delta: np.ndarray) -> np.ndarray:
        """x += delta in place (the residual), then the norm of the new x."""
        return self.ks.add_rms_norm(x, delta, self.weight, self.eps)


# ------------------------------------------------------------------ rotary embeddings
class RoPE:
    """Rotary position embedding, HF layout (rotate_half over the first ``rotary_dim`` dims).

    Tables are computed in float32 exactly as transformers does (angle = pos * inv_freq
    rounded to f32), so long positions round the same way as the oracle. ``scaling`` is a
    config's ``rope_scaling`` (``ROPE_TYPES``): linear, llama3, yarn (with its attention
    factor on cos/sin), longrope (short factors while the sequence's context is within
    the original context, long factors past it, and its attention factor) and dynamic NTK
    (the base grows with the context past ``max_position_embeddings``), each as
    transformers computes it for a sequence of that length. The context is the cache's
    capacity (as llama.cpp picks its factors by n_ctx), not the positions seen so far:
    transformers recomputes the whole sequence when it crosses the original length; a
    KV cache cannot, so the choice is made once per sequence. ``score_factor`` is what YaRN's ``mscale_all_dim`` asks
    of the score scale (MLA families multiply their scale by it).
    """

    def __init__(
        self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int = 0
    ):
        self.rotary_dim = int(rotary_dim)
        self.theta = float(theta)
        self.scaling = dict(scaling) if scaling else None
        self.max_positions = int(max_position_embeddings)
        self.kind = rope_type(self.scaling)
        self.attention_factor = 1.0
        self.score_factor = 1.0
        self.inv_freq = self._inv(self.theta)
        self._long = None
        if self.kind == "linear":
            self.inv_freq = (self.inv_freq / np.float32(float(self.scaling.get("factor", 1.0)))).astype(np.float32)
        elif self.kind == "llama3":
            self.inv_freq = _llama3_inv_freq(self.inv_freq, self.scaling)
        elif self.kind == "yarn":
            self.inv_freq, self.attention_factor, self.score_factor = _yarn(self, self.scaling)
        elif self.kind == "longrope":
            self.inv_freq, self._long, self.attention_factor = _longrope(self, self.scaling)

    def _inv(self, theta: float) -> np.ndarray:
        exps = np.arange(0, self.rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(self.rotary_dim)
        return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)

    def _inv_for(self, positions: np.ndarray, context: int = 0) -> np.ndarray:
        if positions.size == 0 and not context:
            return self.inv_freq
        seq = max(int(context), int(positions.max()) + 1 if positions.size else 0)
        if self.kind == "longrope" and seq > int(self.scaling["original_max_position_embeddings"]):
            return self._long
        if self.kind == "dynamic" and seq > self.max_positions > 0:
            factor, d = float(self.scaling.get("factor", 1.0)), self.rotary_dim
            return self._inv(self.theta * ((factor * seq / self.max_positions) - (factor - 1)) ** (d / (d - 2)))
        return self.inv_freq

    def tables(self, positions: np.ndarray, context: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [n, rotary_dim / 2] for ``positions`` in a sequence of ``context`` tokens
        (0: as long as the last position)."""
        ang = positions.astype(np.float32)[:, None] * self._inv_for(positions, context)[None, :]
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        if self.attention_factor != 1.0:
            f = np.float32(self.attention_factor)
            cos *= f
            sin *= f
        return cos, sin


# The rope_scaling types RoPE computes ("default" / None: plain RoPE).
ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "dynamic")


def rope_type(scaling: dict[str, Any] | None) -> str | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise CortiqError(f"rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return kind


def _llama3_inv_freq(inv: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    factor = float(scaling.get("factor", 1.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    low_wl, high_wl = old / low, old / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wl, inv / np.float32(factor), inv).astype(np.float32)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: "RoPE", sc: dict[str, Any]) -> tuple[np.ndarray, float, float]:
    """transformers' ``_compute_yarn_parameters`` (and ``yarn_apply_mscale``'s score factor)."""
    d, base = rope.rotary_dim, rope.theta
    orig = float(sc["original_max_position_embeddings"])
    factor = sc.get("factor")
    factor = float(factor) if factor is not None else rope.max_positions / orig
    mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")
    attn = sc.get("attention_factor")
    if attn is None:
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attn = _yarn_mscale(factor)
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def corr_dim(rot: float) -> float:
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1).astype(
        np.float32
    )
    pos = (np.float32(base) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))).astype(np.float32)
    extra = np.float32(1.0) / pos
    inter = np.float32(1.0) / (np.float32(factor) * pos)
    keep = np.float32(1.0) - ramp
    inv = (inter * (np.float32(1.0) - keep) + extra * keep).astype(np.float32)
    score = 1.0
    if mscale_all:
        m = _yarn_mscale(factor, float(mscale_all))
        score = m * m
    return inv, float(attn), score


def _longrope(rope: "RoPE", sc: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, float]:
    """transformers' ``_compute_longrope_parameters``: (short inv_freq, long inv_freq, factor)."""
    d = rope.rotary_dim
    orig = float(sc["original_max_position_embeddings"])
    factor = sc.get("factor")
    factor = float(factor) if factor is not None else rope.max_positions / orig
    attn = sc.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    base = (np.float32(rope.theta) ** shape).astype(np.float32)

    def inv(factors: Any) -> np.ndarray:
        f = np.asarray(factors, dtype=np.float32)
        if f.shape != (d // 2,):
            raise CortiqError(f"longrope factors have {f.size} entries, the rotary width {d} needs {d // 2}")
        return (np.float32(1.0) / (f * base)).astype(np.float32)

    return inv(sc["short_factor"]), inv(sc["long_factor"]), float(attn)


# ------------------------------------------------------------------ attention
@dataclass(frozen=True, eq=False)
class AttentionWeights:
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    qkv_bias: np.ndarray | None = None  # [q|k|v] concatenated; zeros where a part has none
    o_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # per-head RMS norm over head_dim (Qwen3)
    k_norm: np.ndarray | None = None


class Attention:
    """Softmax attention with grouped KV heads and RoPE over a preallocated ``KVCache``;
    what differs between architectures are options, not subclasses:

    - ``window``: sliding window of that many keys, the query's own included
      (transformers' ``sliding_window``); 0 = full causal attention;
    - ``scale``: the score scale, default head_dim**-0.5 (Gemma: query_pre_attn_scalar**-0.5);
    - ``v_head_dim`` narrower or wider than ``head_dim`` (MiMo-V2: 128 vs 192);
    - partial rotary: ``rope.rotary_dim`` < head_dim rotates only the first dims;
    - q/k norm: per-head RMS norms when ``w.q_norm``/``w.k_norm`` are given (Qwen3, Gemma 3);
    - ``sinks`` [num_heads]: learned logits that join each head's softmax without a
      value row (MiMo-V2's sliding layers);
    - ``v_scale``: V multiplied by a constant before it enters the cache (MiMo-V2);
    - ``output_gate``: q_proj emits [query | gate] per head and the attention output
      is multiplied by sigmoid(gate) before o_proj (Qwen3-Next);
    - ``rope`` None: no rotary embedding (SmolLM3's NoPE layers);
    - ``softcap``: scores become cap * tanh(score / cap) before the mask (Gemma 2); such
      an attention runs on the numpy twin (``reference.attend``), which has the cap;
    - ``qk_norm_full``: the q/k norms span the whole projection, all heads at once,
      before the split into heads (OLMo 2): ``w.q_norm`` holds num_heads * head_dim
      values, ``w.k_norm`` num_kv_heads * head_dim.
    """

    def __init__(
        self,
        kernels,
        w: AttentionWeights,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int,
        rope: RoPE | None,
        norm_eps: float,
        window: int = 0,
        scale: float | None = None,
        sinks: np.ndarray | None = None,
        v_scale: float = 1.0,
        output_gate: bool = False,
        softcap: float = 0.0,
        qk_norm_full: bool = False,
    ):
        self.ks = kernels
        self.w = w
        self.nh, self.nkv, self.hd, self.vd = num_heads, num_kv_heads, head_dim, v_head_dim
        self.output_gate = bool(output_gate)
        self.qk_norm_full = bool(qk_norm_full)
        self._check_geometry(rope)
        self.rope = rope
        self.eps = norm_eps
        self.v_scale = float(v_scale)
        if not (math.isfinite(float(softcap)) and float(softcap) >= 0):
            raise CortiqError(f"attention soft-cap {softcap} is not a finite number >= 0")
        # What every attend call of this layer shares (scale, window, sinks, cap), made once.
        self.call = AttentionCall(
            head_dim**-0.5 if scale is None else float(scale),
            int(window),
            None if sinks is None else self._check_sinks(sinks),
            float(softcap),
        )
        self._qkv = (w.q, w.k, w.v)
        self._o = (w.o,)

    def _check_geometry(self, rope: RoPE) -> None:
        """The kernels index by these sizes without bounds checks: refuse any weight or
        rotary table that disagrees with them (a corrupt or hostile file) up front."""
        w, nh, nkv, hd, vd = self.w, self.nh, self.nkv, self.hd, self.vd
        q_rows = nh * hd * (2 if self.output_gate else 1)  # the gate rides in q_proj
        want = {
            "q": (q_rows, w.q.cols),
            "k": (nkv * hd, w.q.cols),
            "v": (nkv * vd, w.q.cols),
            "o": (w.o.rows, nh * vd),
        }
        for name, shape in want.items():
            have = getattr(w, name).shape
            if have != shape:
                raise CortiqError(
                    f"tensor {getattr(w, name).name} is {list(have)}, the attention geometry needs {list(shape)}"
                )
        if min(nh, nkv, hd, vd) < 1 or nh % nkv:
            raise CortiqError(f"attention with {nh} heads, {nkv} KV heads, head_dim {hd}: not a valid geometry")
        if self.output_gate and vd != hd:
            raise CortiqError(f"an output gate of head_dim {hd} cannot gate V heads of width {vd}")
        if rope is not None and (not 0 < rope.rotary_dim <= hd or rope.rotary_dim % 2):
            raise CortiqError(f"rotary_dim {rope.rotary_dim} does not fit head_dim {hd}")
        full = self.qk_norm_full
        norms = {"q_norm": (w.q_norm, nh * hd if full else hd), "k_norm": (w.k_norm, nkv * hd if full else hd)}
        for name, (v, width) in norms.items():
            if v is not None and v.shape != (width,):
                raise CortiqError(f"{name} has {v.size} values, the attention geometry needs {width}")
        if (w.q_norm is None) != (w.k_norm is None):
            raise CortiqError("attention has a q_norm without a k_norm or the reverse")
        if w.qkv_bias is not None and w.qkv_bias.shape != (w.q.rows + w.k.rows + w.v.rows,):
            raise CortiqError("q/k/v biases do not match their projections")
        if w.o_bias is not None and w.o_bias.shape != (w.o.rows,):
            raise CortiqError("o_proj bias does not match its projection")

    def _check_sinks(self, sinks: np.ndarray) -> np.ndarray:
        sinks = np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
        if sinks.shape[0] != self.nh:
            raise CortiqError(f"{sinks.shape[0]} attention sinks for {self.nh} heads")
        if not np.isfinite(sinks).all():
            raise CortiqError("attention sinks hold non-finite values")
        return sinks

    def make_cache(self, capacity: int, kv: str = "f32") -> KVCache:
        return KVCache(self.nkv, self.hd, self.vd, capacity, kv_dtype(kv))

    def weights(self) -> list[Weight]:
        return [*self._qkv, *self._o]

    @property
    def projections(self) -> tuple[tuple[Weight, ...], tuple[Weight, ...]]:
        """The weights of its two matmuls: (q, k, v) fused, and o."""
        return self._qkv, self._o

    def __call__(self, x: np.ndarray, cache: KVCache, step: Step) -> np.ndarray:
        ks, n = self.ks, x.shape[0]
        nh, nkv, hd, vd = self.nh, self.nkv, self.hd, self.vd
        qkv = ks.matmul(self._qkv, x)
        if self.w.qkv_bias is not None:
            qkv += self.w.qkv_bias
        nq, nk = nh * hd * (2 if self.output_gate else 1), nkv * hd
        gate = None
        if self.output_gate:
            qg = qkv[:, :nq].reshape(n, nh, 2 * hd)
            q = np.ascontiguousarray(qg[:, :, :hd])
            gate = qg[:, :, hd:].reshape(n, nh * hd)
        else:
            q = np.ascontiguousarray(qkv[:, :nq]).reshape(n, nh, hd)
        k = np.ascontiguousarray(qkv[:, nq : nq + nk]).reshape(n, nkv, hd)
        v = qkv[:, nq + nk :].reshape(n, nkv, vd)
        if self.v_scale != 1.0:
            v = v * np.float32(self.v_scale)
        if self.w.q_norm is not None:
            rq, rk = ((n, nh * hd), (n, nkv * hd)) if self.qk_norm_full else ((n * nh, hd), (n * nkv, hd))
            q = ks.rms_norm(q.reshape(rq), self.w.q_norm, self.eps).reshape(n, nh, hd)
            k = ks.rms_norm(k.reshape(rk), self.w.k_norm, self.eps).reshape(n, nkv, hd)
        if self.rope is not None:
            cos, sin = step.rope_tables(self.rope)
            ks.rope(q, cos, sin)
            ks.rope(k, cos, sin)
        start = cache.append(k, v)
        o = ks.attend(q, cache.keys, cache.values, start, self.call)
        o = o.reshape(n, nh * vd)
        if gate is not None:
            o = np.ascontiguousarray(o * (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate))), dtype=np.float32)
        out = ks.matmul(self._o, o)
        if self.w.o_bias is not None:
            out += self.w.o_bias
        return out


# ------------------------------------------------------------------ feed-forward
class GatedMLP:
    """down(act(gate(x)) * up(x)); gate and up run as one fused matmul. ``act`` is the
    config's activation name: the tanh GELU (Gemma's GeGLU) or SiLU (SwiGLU)."""

    def __init__(self, kernels, gate: Weight, up: Weight, down: Weight, act: str = "silu"):
        if not (gate.shape == up.shape == (down.cols, down.rows)):
            raise CortiqError(
                f"MLP tensors {gate.name} {list(gate.shape)}, {up.name} {list(up.shape)}, {down.name} {list(down.shape)} disagree"
            )
        self.ks = kernels
        self._gu = (gate, up)
        self._down = (down,)
        self.gelu = act in GELU_TANH
        self._act = kernels.gelu_tanh_mul if self.gelu else kernels.silu_mul

    @property
    def projections(self) -> tuple[tuple[Weight, ...], tuple[Weight, ...]]:
        """The weights of its two matmuls: (gate, up) fused, and down."""
        return self._gu, self._down

    def weights(self) -> list[Weight]:
        return [*self._gu, *self._down]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.ks.matmul(self._down, self._act(self.ks.matmul(self._gu, x)))


# The config names of the tanh-approximated GELU.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


# ------------------------------------------------------------------ the residual block
class Block:
    """Pre-norm decoder block: h = x + attn(norm(x)); x = h + mlp(norm(h)).
    ``residual_scale`` (Granite) multiplies each sublayer's output before the add."""

    def __init__(self, attn_norm: RMSNorm, attn, mlp_norm: RMSNorm, mlp, residual_scale: float = 1.0):
        self.attn_norm = attn_norm
        self.attn = attn
        self.mlp_norm = mlp_norm
        self.mlp = mlp
        self.residual_scale = float(residual_scale)

    def make_cache(self, capacity: int, kv: str = "f32"):
        return self.attn.make_cache(capacity, kv)

    def __call__(self, x: np.ndarray, cache, step: Step) -> None:
        """Advance the residual stream ``x`` [n, hidden] in place."""
        a = self.attn(self.attn_norm(x), cache, step)
        if self.residual_scale != 1.0:
            a *= np.float32(self.residual_scale)
            h = self.mlp_norm.add_then_norm(x, a)
            x += self.mlp(h) * np.float32(self.residual_scale)
            return
        h = self.mlp_norm.add_then_norm(x, a)
        x += self.mlp(h)

    def weights(self) -> list[Weight]:
        return self.attn.weights() + self.mlp.weights()


class SandwichBlock:
    """x += post_attn(attn(pre_attn(x))); x += post_ffn(mlp(pre_ffn(x))): each sublayer's
    output is normed before it joins the residual stream (Gemma 2/3). ``pre_attn`` /
    ``pre_ffn`` None: the sublayer reads x itself (OLMo 2 norms only the outputs)."""

    def __init__(self, norms: tuple[RMSNorm | None, RMSNorm, RMSNorm | None, RMSNorm], attn, mlp):
        self.pre_attn, self.post_attn, self.pre_ffn, self.post_ffn = norms
        self.attn = attn
        self.mlp = mlp

    def make_cache(self, capacity: int, kv: str = "f32"):
        return self.attn.make_cache(capacity, kv)

    def __call__(self, x: np.ndarray, cache, step: Step) -> None:
        a_in = x.copy() if self.pre_attn is None else self.pre_attn(x)
        x += self.post_attn(self.attn(a_in, cache, step))
        m_in = x.copy() if self.pre_ffn is None else self.pre_ffn(x)
        x += self.post_ffn(self.mlp(m_in))

    def weights(self) -> list[Weight]:
        return self.attn.weights() + self.mlp.weights()
