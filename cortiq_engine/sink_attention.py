"""Attention with learned sinks, a sliding window and its own V head width (MiMo-V2).

MiMo-V2's sliding-window layers (and its MTP draft layers) differ from plain
attention in three ways:

- a learned *sink* logit per query head joins the softmax:
  ``p = softmax([scores, sink])``; the sink takes probability mass but has no
  value row, so the output is ``sum_j p_j v_j`` over the real keys only;
- the window covers the query and the ``window - 1`` keys before it
  (transformers' ``sliding_window`` semantics: 129 = 128 previous + self);
- V heads may be narrower than Q/K heads (192 vs 128), and V is scaled by a
  constant (``attention_value_scale``) before it enters the cache.

``attend_sinks_reference`` is the plainly written numpy oracle; ``attend_sinks``
is the compiled kernel the engine runs (each query row is computed on its own,
so a batch of rows gives exactly the numbers single-row decode gives).
``SinkAttention`` is a drop-in for ``layers.Attention`` (same call signature,
same ``make_cache``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from cortiq_engine.cache import KVCache
from cortiq_engine.layers import Attention, AttentionWeights, RoPE, Step


def attend_sinks_reference(
    q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, window: int, scale: float, sinks: np.ndarray | None
) -> np.ndarray:
    """Causal GQA attention of n new queries over cache rows 0..start+n-1, with sinks.

    q [n, heads, d]; kc [kv_heads, cap, d]; vc [kv_heads, cap, dv]; sinks [heads] or None.
    Query i (absolute row start+i) sees rows max(0, start+i-window+1)..start+i (window > 0).
    Returns [n, heads, dv]. Written for clarity, in float64.
    """
    n, heads, _ = q.shape
    group = heads // kc.shape[0]
    out = np.zeros((n, heads, vc.shape[2]), np.float64)
    for i in range(n):
        hi = start + i + 1
        lo = max(0, hi - window) if window > 0 else 0
        for h in range(heads):
            g = h // group
            s = (kc[g, lo:hi].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            logits = s if sinks is None else np.append(s, np.float64(sinks[h]))
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out[i, h] = p[: hi - lo] @ vc[g, lo:hi].astype(np.float64)
    return out.astype(np.float32)


@njit(parallel=True, fastmath=True, cache=True)
def _attend_sinks(q, kc, vc, start, window, scale, sinks, out):
    n, heads, d = q.shape
    group = heads // kc.shape[0]
    dv = vc.shape[2]
    for t in prange(n * heads):
        i = t // heads
        h = t % heads
        g = h // group
        hi = start + i + 1
        lo = 0
        if window > 0 and hi - window > 0:
            lo = hi - window
        s = np.empty(hi - lo, np.float32)
        mx = sinks[h]  # the sink joins the max, so a dominant sink cannot overflow exp
        for j in range(lo, hi):
            acc = np.float32(0.0)
            for c in range(d):
                acc += q[i, h, c] * kc[g, j, c]
            acc *= scale
            s[j - lo] = acc
            if acc > mx:
                mx = acc
        tot = np.exp(sinks[h] - mx)
        for j in range(hi - lo):
            e = np.exp(s[j] - mx)
            s[j] = e
            tot += e
        o = np.zeros(dv, np.float32)
        for j in range(lo, hi):
            p = s[j - lo]
            for c in range(dv):
                o[c] += p * vc[g, j, c]
        inv = np.float32(1.0) / tot
        for c in range(dv):
            out[i, h, c] = o[c] * inv


def attend_sinks(
    q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, window: int, scale: float, sinks: np.ndarray | None
) -> np.ndarray:
    """Compiled ``attend_sinks_reference`` (f32); ``sinks=None`` is plain attention (sink = -inf)."""
    heads = q.shape[1]
    s = np.full(heads, -np.inf, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    out = np.empty((q.shape[0], heads, vc.shape[2]), np.float32)
    _attend_sinks(np.ascontiguousarray(q, dtype=np.float32), kc, vc, int(start), int(window), np.float32(scale), s, out)
    return out


class SinkAttention(Attention):
    """``layers.Attention`` plus learned sinks and a V scale; the window and the V head
    width come through ``Attention``'s own arguments.

    ``sinks`` [num_heads] (None: no sinks); ``v_scale`` multiplies V before caching.
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
        rope: RoPE,
        norm_eps: float,
        window: int = 0,
        sinks: np.ndarray | None = None,
        v_scale: float = 1.0,
    ):
        super().__init__(
            kernels, w, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            v_head_dim=v_head_dim, rope=rope, norm_eps=norm_eps, window=window,
        )
        if sinks is not None:
            sinks = np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
            if sinks.shape[0] != num_heads:
                raise ValueError(f"{sinks.shape[0]} sinks for {num_heads} heads")
        self.sinks = sinks
        self.v_scale = float(v_scale)

    def __call__(self, x: np.ndarray, cache: KVCache, step: Step) -> np.ndarray:
        ks, n = self.ks, x.shape[0]
        qkv = ks.matmul(self._qkv, x)
        if self.w.qkv_bias is not None:
            qkv += self.w.qkv_bias
        nq, nk = self.nh * self.hd, self.nkv * self.hd
        q = np.ascontiguousarray(qkv[:, :nq]).reshape(n, self.nh, self.hd)
        k = np.ascontiguousarray(qkv[:, nq : nq + nk]).reshape(n, self.nkv, self.hd)
        v = qkv[:, nq + nk :].reshape(n, self.nkv, self.vd)
        if self.v_scale != 1.0:
            v = v * np.float32(self.v_scale)
        if self.w.q_norm is not None:
            q = ks.rms_norm(q.reshape(n * self.nh, self.hd), self.w.q_norm, self.eps).reshape(n, self.nh, self.hd)
            k = ks.rms_norm(k.reshape(n * self.nkv, self.hd), self.w.k_norm, self.eps).reshape(n, self.nkv, self.hd)
        cos, sin = step.rope_tables(self.rope)
        ks.rope(q, cos, sin)
        ks.rope(k, cos, sin)
        start = cache.append(k, v)
        if getattr(ks, "name", "") == "numpy":
            o = attend_sinks_reference(q, cache.keys, cache.values, start, self.window, self.scale, self.sinks)
        else:
            o = attend_sinks(q, cache.keys, cache.values, start, self.window, self.scale, self.sinks)
        out = ks.matmul(self._o, o.reshape(n, self.nh * self.vd))
        if self.w.o_bias is not None:
            out += self.w.o_bias
        return out
