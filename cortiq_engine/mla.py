"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) and its latent cache.

Per position the layer projects the hidden state to

- a query per head: ``q_a_proj`` -> RMS norm -> ``q_b_proj`` (or ``q_proj`` when
  ``q_lora_rank`` is 0), split into a ``qk_nope_head_dim`` part and a rotary part of
  ``qk_rope_head_dim``;
- one compressed row: ``kv_a_proj_with_mqa`` gives [latent (``kv_lora_rank``) | k_rope
  (``qk_rope_head_dim``)]; the latent is RMS-normed, and k_rope is a single rotary key
  every head shares.

``kv_b_proj`` expands a latent into each head's non-rotary key and its value
(rows per head: [k_nope (qk_nope_head_dim) | v (v_head_dim)]). Scores use
qk_head_dim**-0.5 (times YaRN's ``mscale_all_dim`` factor, ``RoPE.score_factor``).
llama.cpp's newer GGUFs store it split per head instead: ``k_b_proj.{h}``
[kv_lora_rank, qk_nope_head_dim] (the key part, transposed) and ``v_b_proj.{h}``
[v_head_dim, kv_lora_rank]; the layer reads either form (exactly one of them).

**The cache** (``MlaCache``) holds [normed latent | rotated k_rope] per position:
kv_lora_rank + qk_rope_head_dim values, not per-head keys and values.

**Two forms of the same attention.**

- absorbed (decode and every speculative verify, up to ``ABSORB_ROWS`` rows): kv_b_proj's
  key part folds into the query, q_latent_h = W_uk_h^T q_nope_h, so a head's score is
  q_latent_h . latent + q_rope_h . k_rope: one-KV-head attention over the cache rows as
  they are, keys = values = the cache (the value pass also carries the k_rope columns,
  which are dropped). The head's output is W_uv_h (softmax . latent). A decode step
  reads the latent cache once, whatever the head count.
- expanded (prefill): kv_b_proj turns every cached latent into per-head keys and values,
  then ordinary multi-head attention; cheaper when many queries share the expansion.

Both give the same logits to float rounding (tests/test_arch_deepseek_v3.py). The
absorbed products run one row at a time, so a verify's rows are bit for bit their
one-row decode results.

**Interleaved rotary** (``rope_interleave``, DeepSeek-V3's release layout): the rotary
parts of q and k_rope come out of the projections as pairs (x0, x1), (x2, x3), ...;
they are gathered into halves [x0, x2, ... | x1, x3, ...] at run time, after which the
half-split rotation (``kernels.rope``) is exactly transformers'
``apply_rotary_pos_emb_interleave`` (whose output has the same half layout). The
weights stay as the checkpoint stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.arch import MlaConfig
from formats.errors import CortiqError
from formats.manifest import Manifest
from cortiq_engine.cache import KVCache, kv_dtype
from cortiq_engine.layers import RoPE, Step
from cortiq_engine.kernels.reference import AttentionCall
from cortiq_engine.weights import Weight

# Calls of up to this many rows take the absorbed form (decode, speculative verify);
# the compiled attention's row-exact route covers the same sizes.
ABSORB_ROWS = 16
# DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon whatever
# rms_norm_eps says (transformers and the reference code alike).
LATENT_NORM_EPS = 1e-6


# ------------------------------------------------------------------ manifest
def mla_manifest(p: str, hidden: int, num_heads: int, m: MlaConfig) -> Manifest:
    """The attention tensors under ``p`` (``model.layers.{i}.``); biases read when present."""
    a = p + "self_attn."
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    req = {
        a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, hidden),
        a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
        a + "o_proj.weight": (hidden, num_heads * m.v_head_dim),
    }
    opt = {a + "kv_a_proj_with_mqa.bias": (m.kv_lora_rank + m.qk_rope_head_dim,), a + "o_proj.bias": (hidden,)}
    # kv_b_proj whole, or split per head (llama.cpp's attn_k_b / attn_v_b): the loader
    # takes exactly one complete form.
    opt[a + "kv_b_proj.weight"] = (num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    for h in range(num_heads):
        opt[f"{a}k_b_proj.{h}.weight"] = (m.kv_lora_rank, m.qk_nope_head_dim)
        opt[f"{a}v_b_proj.{h}.weight"] = (m.v_head_dim, m.kv_lora_rank)
    if m.q_lora_rank:
        req[a + "q_a_proj.weight"] = (m.q_lora_rank, hidden)
        req[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        req[a + "q_b_proj.weight"] = (num_heads * qk, m.q_lora_rank)
        opt[a + "q_a_proj.bias"] = (m.q_lora_rank,)
    else:
        req[a + "q_proj.weight"] = (num_heads * qk, hidden)
    return Manifest(req, opt)


# ------------------------------------------------------------------ the cache
class MlaCache(KVCache):
    """Per position [normed latent | rotated k_rope]: ``keys`` [1, capacity, kv_lora_rank +
    qk_rope_head_dim] of the engine's ``kv_cache`` type. ``values`` is the same array (the
    absorbed attention weighs the latent columns of the rows it scores), so the cache
    costs kv_lora_rank + qk_rope_head_dim values per position. Rollback (``truncate``)
    and the capacity and f16 range checks (``check_room``) are ``KVCache``'s."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, capacity: int, dtype: type = np.float32):
        self.capacity = int(capacity)
        self.rank = int(kv_lora_rank)
        self.rope_dim = int(rope_dim)
        self.keys = np.zeros((1, self.capacity, self.rank + self.rope_dim), dtype)
        self.values = self.keys
        self.length = 0
        self.writes = 0

    def append(self, latent: np.ndarray, k_rope: np.ndarray) -> int:
        """Store n rows (latent [n, kv_lora_rank], k_rope [n, qk_rope_head_dim]); returns the first."""
        n, start = latent.shape[0], self.length
        self.check_room(n, latent, k_rope)
        self.keys[0, start : start + n, : self.rank] = latent
        self.keys[0, start : start + n, self.rank :] = k_rope
        self.length += n
        self.writes += n
        return start

    def rows_f32(self, hi: int) -> np.ndarray:
        """Rows 0..hi-1 as f32 [hi, kv_lora_rank + qk_rope_head_dim] (an f16 cache widened, exactly)."""
        return np.ascontiguousarray(self.keys[0, :hi], dtype=np.float32)

    def keep_last(self, n: int) -> None:
        n = min(n, self.length)
        if n < self.length:
            lo = self.length - n
            self.keys[:, :n] = self.keys[:, lo : self.length].copy()
        self.length = n


# ------------------------------------------------------------------ the attention
@dataclass(frozen=True, eq=False)
class MlaWeights:
    q_b: Weight  # q_b_proj (after q_a_proj and its norm), or q_proj when q_a is None
    kv_a: Weight  # kv_a_proj_with_mqa: [latent | k_rope] rows
    kv_a_norm: np.ndarray
    kv_b: Weight | None  # per head [k_nope | v] rows, latent columns; None: k_b and v_b
    o: Weight
    q_a: Weight | None = None
    q_a_norm: np.ndarray | None = None
    q_a_bias: np.ndarray | None = None
    kv_a_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None
    k_b: tuple[Weight, ...] | None = None  # per head [kv_lora_rank, nope]: W_uk_h transposed
    v_b: tuple[Weight, ...] | None = None  # per head [v, kv_lora_rank]: W_uv_h


class MlaAttention:
    """Multi-head latent attention over an ``MlaCache`` (see the module doc).

    ``absorb``: True, every call takes the absorbed form; False, every call the expanded
    one; None (default): calls of up to ``ABSORB_ROWS`` rows absorbed, longer ones expanded.
    """

    def __init__(
        self,
        kernels,
        w: MlaWeights,
        m: MlaConfig,
        *,
        num_heads: int,
        rope: RoPE,
        absorb: bool | None = None,
        latent_eps: float = LATENT_NORM_EPS,
    ):
        self.ks = kernels
        self.w = w
        self.m = m
        self.nh = int(num_heads)
        self.nope, self.r, self.rank, self.vd = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        self.qa_rows = m.q_lora_rank
        self._check_geometry(rope)
        self.rope = rope
        self.absorb = absorb
        self.eps = float(latent_eps)
        self.call = AttentionCall(float((self.nope + self.r) ** -0.5 * rope.score_factor))
        # Interleaved pairs -> [evens | odds]: the layout the half-split rotation takes.
        self.perm = np.concatenate([np.arange(0, self.r, 2), np.arange(1, self.r, 2)]) if m.rope_interleave else None
        self._in = (w.q_a, w.kv_a) if w.q_a is not None else (w.q_b, w.kv_a)
        in_bias = [w.q_a_bias if w.q_a is not None else None, w.kv_a_bias]
        self._in_bias = None
        if any(b is not None for b in in_bias):
            self._in_bias = np.concatenate(
                [b if b is not None else np.zeros(x.rows, np.float32) for b, x in zip(in_bias, self._in)]
            ).astype(np.float32)
        # kv_b_proj split per head, f32, for the absorbed products: W_uk [heads, nope, rank]
        # (a query's nope part times it lands in latent space) and W_uv^T [heads, rank, v].
        if w.kv_b is not None:
            kvb = w.kv_b.dequantize().reshape(self.nh, self.nope + self.vd, self.rank)
            self.w_uk = np.ascontiguousarray(kvb[:, : self.nope, :], dtype=np.float32)
            self.w_uv_t = np.ascontiguousarray(kvb[:, self.nope :, :].transpose(0, 2, 1), dtype=np.float32)
        else:
            self.w_uk = np.ascontiguousarray(np.stack([k.dequantize().T for k in w.k_b]), dtype=np.float32)
            self.w_uv_t = np.ascontiguousarray(np.stack([v.dequantize().T for v in w.v_b]), dtype=np.float32)

    def _check_geometry(self, rope: RoPE) -> None:
        """The products index by these sizes: refuse any tensor that disagrees with them."""
        w, nh, nope, r, rank, vd = self.w, self.nh, self.nope, self.r, self.rank, self.vd
        hidden = w.kv_a.cols
        want = {"kv_a": (w.kv_a, (rank + r, hidden)), "o": (w.o, (w.o.rows, nh * vd))}
        some_split, whole_split = (w.k_b is not None or w.v_b is not None), (w.k_b is not None and w.v_b is not None)
        if not ((w.kv_b is not None and not some_split) or (w.kv_b is None and whole_split)):
            raise CortiqError("latent attention needs kv_b_proj or, per head, k_b_proj and v_b_proj (exactly one form)")
        if w.kv_b is not None:
            want["kv_b"] = (w.kv_b, (nh * (nope + vd), rank))
        else:
            if len(w.k_b) != nh or len(w.v_b) != nh:
                raise CortiqError(
                    f"latent attention with {nh} heads has {len(w.k_b)} k_b_proj and {len(w.v_b)} v_b_proj"
                )
            for h in range(nh):
                want[f"k_b{h}"] = (w.k_b[h], (rank, nope))
                want[f"v_b{h}"] = (w.v_b[h], (vd, rank))
        if w.q_a is not None:
            want["q_a"] = (w.q_a, (self.qa_rows, hidden))
            want["q_b"] = (w.q_b, (nh * (nope + r), self.qa_rows))
        else:
            want["q_b"] = (w.q_b, (nh * (nope + r), hidden))
        for t, shape in want.values():
            if t.shape != shape:
                raise CortiqError(
                    f"tensor {t.name} is {list(t.shape)}, the latent attention geometry needs {list(shape)}"
                )
        if (w.q_a is None) != (self.qa_rows == 0) or (w.q_a is None) != (w.q_a_norm is None):
            raise CortiqError(
                f"latent attention with q_lora_rank {self.qa_rows} needs q_a_proj and its norm exactly then"
            )
        vecs = {
            "kv_a_layernorm": (w.kv_a_norm, rank),
            "q_a_layernorm": (w.q_a_norm, self.qa_rows),
            "q_a_proj bias": (w.q_a_bias, self.qa_rows),
            "kv_a_proj_with_mqa bias": (w.kv_a_bias, rank + r),
            "o_proj bias": (w.o_bias, w.o.rows),
        }
        for name, (v, size) in vecs.items():
            if v is not None and v.shape != (size,):
                raise CortiqError(f"{name} has {v.size} values, the latent attention needs {size}")
        if min(nh, nope, r, rank, vd) < 1 or r % 2:
            raise CortiqError(
                f"latent attention with {nh} heads, nope {nope}, rope {r}, rank {rank}, v {vd}: not a valid geometry"
            )
        if rope.rotary_dim != r:
            raise CortiqError(f"rotary_dim {rope.rotary_dim} does not match qk_rope_head_dim {r}")

    def make_cache(self, capacity: int, kv: str = "f32") -> MlaCache:
        return MlaCache(self.rank, self.r, capacity, kv_dtype(kv))

    def weights(self) -> list[Weight]:
        split = (*(self.w.k_b or ()), *(self.w.v_b or ()))
        return [x for x in (self.w.q_a, self.w.q_b, self.w.kv_a, self.w.kv_b, *split, self.w.o) if x is not None]

    def _halves(self, x: np.ndarray) -> np.ndarray:
        """The rotary part as the half-split rotation takes it (contiguous)."""
        return np.ascontiguousarray(x[..., self.perm] if self.perm is not None else x, dtype=np.float32)

    def __call__(self, x: np.ndarray, cache: MlaCache, step: Step) -> np.ndarray:
        ks, n = self.ks, x.shape[0]
        nh, nope, r, rank = self.nh, self.nope, self.r, self.rank
        y = ks.matmul(self._in, x)
        if self._in_bias is not None:
            y += self._in_bias
        split = self._in[0].rows
        q = y[:, :split]
        if self.w.q_a is not None:
            q = ks.matmul((self.w.q_b,), ks.rms_norm(np.ascontiguousarray(q), self.w.q_a_norm, self.eps))
        q = q.reshape(n, nh, nope + r)
        q_nope = q[:, :, :nope]
        q_rope = self._halves(q[:, :, nope:])
        latent = ks.rms_norm(np.ascontiguousarray(y[:, split : split + rank]), self.w.kv_a_norm, self.eps)
        k_rope = self._halves(y[:, split + rank :]).reshape(n, 1, r)
        cos, sin = step.rope_tables(self.rope)
        ks.rope(q_rope, cos, sin)
        ks.rope(k_rope, cos, sin)
        start = cache.append(latent, k_rope[:, 0])
        absorb = self.absorb if self.absorb is not None else n <= ABSORB_ROWS
        o = self._absorbed(q_nope, q_rope, cache, start) if absorb else self._expanded(q_nope, q_rope, cache, start)
        out = ks.matmul((self.w.o,), o.reshape(n, nh * self.vd))
        if self.w.o_bias is not None:
            out += self.w.o_bias
        return out

    def _absorbed(self, q_nope: np.ndarray, q_rope: np.ndarray, cache: MlaCache, start: int) -> np.ndarray:
        """Scores and weighted sums in latent space; each row's products on their own."""
        n, nh, rank = q_nope.shape[0], self.nh, self.rank
        q = np.empty((n, nh, rank + self.r), np.float32)
        q[:, :, rank:] = q_rope
        by_rows = n <= ABSORB_ROWS
        if by_rows:
            for i in range(n):
                q[i, :, :rank] = np.matmul(q_nope[i][:, None, :], self.w_uk)[:, 0, :]
        else:
            q[:, :, :rank] = np.matmul(q_nope.transpose(1, 0, 2), self.w_uk).transpose(1, 0, 2)
        o_lat = self.ks.attend(q, cache.keys, cache.values, start, self.call)[:, :, :rank]
        if by_rows:
            return np.stack([np.matmul(o_lat[i][:, None, :], self.w_uv_t)[:, 0, :] for i in range(n)])
        return np.ascontiguousarray(np.matmul(o_lat.transpose(1, 0, 2), self.w_uv_t).transpose(1, 0, 2))

    def _expanded(self, q_nope: np.ndarray, q_rope: np.ndarray, cache: MlaCache, start: int) -> np.ndarray:
        """Every cached latent expanded to per-head keys and values, then plain attention."""
        n, nh, nope, rank, vd = q_nope.shape[0], self.nh, self.nope, self.rank, self.vd
        hi = start + n
        rows = cache.rows_f32(hi)
        keys = np.empty((nh, hi, nope + self.r), np.float32)
        latent = np.ascontiguousarray(rows[:, :rank])
        if self.w.kv_b is not None:
            kv = self.ks.matmul((self.w.kv_b,), latent).reshape(hi, nh, nope + vd)
            keys[:, :, :nope] = kv[:, :, :nope].transpose(1, 0, 2)
            values = np.ascontiguousarray(kv[:, :, nope:].transpose(1, 0, 2))
        else:  # the per-head split form: the same products from the f32 W_uk / W_uv^T
            keys[:, :, :nope] = np.matmul(latent[None], self.w_uk.transpose(0, 2, 1))
            values = np.ascontiguousarray(np.matmul(latent[None], self.w_uv_t))
        keys[:, :, nope:] = rows[None, :, rank:]
        q = np.ascontiguousarray(np.concatenate([q_nope, q_rope], axis=2), dtype=np.float32)
        return self.ks.attend(q, keys, values, start, self.call)
