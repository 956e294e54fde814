"""The reference kernel set: plain numpy, easy to read, the oracle for the fast one.

Every operation of the engine's forward pass goes through a kernel set; the fast
set (``fast.py``) overrides the hot ones with compiled code and must agree with
this one to float rounding (tests/test_engine_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cortiq_engine.weights import Weight

# Rows of a weight dequantized at once: bounds the scratch tile (~4 MB of f32).
TILE_ELEMS = 1 << 20
# f32 elements an elementwise pass works on at once (256 KB: stays in L2).
BLOCK_ELEMS = 1 << 16
# Query rows per attention block: [group, block, keys] scores stay in cache.
ATTN_BLOCK = 128


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """What a layer's attention calls share, built once by the layer and passed to every
    kernel set's ``attend``: ``scale`` multiplies the scores; ``window`` > 0 is a sliding
    window of that many rows counting the query's own; ``sinks`` f32 [heads] (MiMo-V2,
    gpt-oss) are learned logits that join each head's softmax without a value row, so
    they only take probability mass: p = softmax([scores, sink]), out = sum_j p_j v_j;
    ``softcap`` > 0 (Gemma 2) turns scores into cap * tanh(score / cap) before the mask,
    which only the reference computes (``attend``)."""

    scale: float
    window: int = 0
    sinks: np.ndarray | None = None
    softcap: float = 0.0

    def __post_init__(self) -> None:
        if self.sinks is not None:  # the layout the compiled kernels take, made once
            object.__setattr__(self, "sinks", np.ascontiguousarray(self.sinks, dtype=np.float32))

    @classmethod
    def of(cls, call: "AttentionCall | int", scale: float | None, sinks: np.ndarray | None) -> "AttentionCall":
        """``call`` itself, or the record of ``attend``'s positional form (window, scale, sinks)."""
        return call if isinstance(call, AttentionCall) else cls(float(scale), int(call), sinks)


def tile_rows(w: Weight) -> int:
    return max(16, min(w.rows, TILE_ELEMS // max(w.cols, 1)))


class NumpyKernels:
    name = "numpy"
    # Rows up to which matmul/attend give each row of a call bit for bit its one-row
    # result: BLAS promises it for no batch, so only for one row (``RowExact`` extends it).
    row_exact_rows = 1

    # ------------------------------------------------------------ matmul
    def matmul(self, ws: Sequence[Weight], X: np.ndarray) -> np.ndarray:
        """X [n, cols] times each W^T, outputs side by side: [n, sum(rows)]."""
        n = X.shape[0]
        out = np.empty((n, sum(w.rows for w in ws)), np.float32)
        c0 = 0
        for w in ws:
            if w.kind.native:
                np.matmul(X, w.parts["data"].T, out=out[:, c0 : c0 + w.rows])
            else:
                step = tile_rows(w)
                for r0 in range(0, w.rows, step):
                    r1 = min(w.rows, r0 + step)
                    out[:, c0 + r0 : c0 + r1] = X @ w.dequantize(r0, r1).T
            c0 += w.rows
        return out

    # ------------------------------------------------------------ elementwise
    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        var = np.mean(np.square(x), axis=-1, keepdims=True)
        return (w * (x / np.sqrt(var + np.float32(eps)))).astype(np.float32)

    def add_rms_norm(self, x: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """x += delta in place (the residual stream), then rms_norm(x)."""
        x += delta
        return self.rms_norm(x, w, eps)

    def silu_mul(self, gu: np.ndarray) -> np.ndarray:
        """silu(gate) * up for gu = [gate | up]; in row blocks that stay in cache."""
        n, k = gu.shape[0], gu.shape[1] // 2
        out = np.empty((n, k), np.float32)
        step = max(1, BLOCK_ELEMS // max(k, 1))
        for r0 in range(0, n, step):
            g, u, o = gu[r0 : r0 + step, :k], gu[r0 : r0 + step, k:], out[r0 : r0 + step]
            np.negative(g, out=o)
            np.exp(o, out=o)
            o += np.float32(1.0)
            np.divide(g, o, out=o)
            o *= u
        return out

    def gelu_tanh_mul(self, gu: np.ndarray) -> np.ndarray:
        """gelu_tanh(gate) * up for gu = [gate | up] (GeGLU, Gemma): GELU with the tanh
        approximation 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as torch's
        ``gelu(approximate="tanh")``; in row blocks that stay in cache."""
        n, k = gu.shape[0], gu.shape[1] // 2
        out = np.empty((n, k), np.float32)
        c = np.float32(np.sqrt(2.0 / np.pi))
        step = max(1, BLOCK_ELEMS // max(k, 1))
        for r0 in range(0, n, step):
            g, u, o = gu[r0 : r0 + step, :k], gu[r0 : r0 + step, k:], out[r0 : r0 + step]
            np.multiply(g, g, out=o)
            o *= np.float32(0.044715)
            o += np.float32(1.0)
            o *= g
            o *= c
            np.tanh(o, out=o)
            o += np.float32(1.0)
            o *= g
            o *= np.float32(0.5)
            o *= u
        return out

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        """In place on x [n, heads, d]: rotate dims 0..2*half (HF rotate_half layout)."""
        half = cos.shape[1]
        a = x[:, :, :half].copy()
        b = x[:, :, half : 2 * half].copy()
        c = cos[:, None, :]
        s = sin[:, None, :]
        x[:, :, :half] = a * c - b * s
        x[:, :, half : 2 * half] = b * c + a * s

    # ------------------------------------------------------------ attention
    def attend(self, q, kc, vc, start: int, call: AttentionCall | int, scale=None, sinks=None) -> np.ndarray:
        """Causal GQA attention over a KV cache (``attend``). ``call``: the layer's
        ``AttentionCall``, or its window followed by ``scale`` and ``sinks``."""
        call = AttentionCall.of(call, scale, sinks)
        return attend(q, kc, vc, start, call, ROW_EXACT_ROWS if call.softcap else 0)

    # ------------------------------------------------------------ linear attention
    def delta_rule(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Gated DeltaNet's recurrence (``gated_delta_rule``): (o, the new state)."""
        return gated_delta_rule(q, k, v, g, beta, state)

    def warmup(self, ws: Sequence[Weight]) -> None:
        """Compile whatever needs compiling (nothing here)."""


# Calls of at most this many rows are computed row by row (``row_exact.py``'s 16).
ROW_EXACT_ROWS = 16


def attend(
    q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, call: AttentionCall, rows_alone: int = 0
) -> np.ndarray:
    """Causal GQA attention of n new queries over cache rows 0..start+n-1.

    q [n, heads, d]; kc [kv_heads, cap, d]; vc [kv_heads, cap, dv] -> [n, heads, dv].
    Query i sees rows lo..start+i (lo > 0 only with ``call.window``), with ``call``'s
    scale, sinks and cap. Queries go in blocks, each against only the keys it can see:
    causal prefill then computes about half the scores, and a block's scores stay in
    cache. Calls of up to ``rows_alone`` rows (decode, a speculative verify) run row by
    row instead, so a verify row gets bit for bit the numbers its one-row decode gets.
    """
    out = np.empty((q.shape[0], q.shape[1], vc.shape[2]), np.float32)
    if kc.dtype != np.float32:  # an f16 cache: the rows the queries see, widened (exact)
        hi = start + q.shape[0]
        kc, vc = kc[:, :hi].astype(np.float32), vc[:, :hi].astype(np.float32)
    qs = q * np.float32(call.scale)  # n*d multiplies instead of n*keys
    jobs = (
        attention_jobs(q.shape[0], kc.shape[0])
        if q.shape[0] > rows_alone
        else [(i, i + 1, g) for i in range(q.shape[0]) for g in range(kc.shape[0])]
    )
    for job in jobs:
        attend_block(qs, kc, vc, start, call, out, *job)
    return out


def softcap_attend(
    q: np.ndarray,
    kc: np.ndarray,
    vc: np.ndarray,
    start: int,
    window: int,
    scale: float,
    softcap: float,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """``attend`` with Gemma 2's tanh cap on the scores (the compiled routes have no cap)."""
    return attend(q, kc, vc, start, AttentionCall(scale, window, sinks, softcap), ROW_EXACT_ROWS)


def attention_jobs(n: int, kv_heads: int) -> list[tuple[int, int, int]]:
    """(first query, end query, KV head) blocks: independent pieces of one attention call."""
    return [(i0, min(n, i0 + ATTN_BLOCK), g) for i0 in range(0, n, ATTN_BLOCK) for g in range(kv_heads)]


def attend_block(
    qs: np.ndarray,
    kc: np.ndarray,
    vc: np.ndarray,
    start: int,
    call: AttentionCall,
    out: np.ndarray,
    i0: int,
    i1: int,
    g: int,
) -> None:
    """Queries i0..i1 of KV head g's group (``qs`` already scaled by ``call.scale``) into ``out``."""
    window, sinks, softcap = call.window, call.sinks, call.softcap
    group = qs.shape[1] // kc.shape[0]
    hi = start + i1  # the block's last query sees keys < hi
    lo = max(0, start + i0 - window + 1) if window > 0 else 0  # its first sees keys >= lo
    qg = qs[i0:i1, g * group : (g + 1) * group, :].transpose(1, 0, 2)  # [group, b, d]
    s = np.matmul(qg, kc[g, lo:hi].T)  # [group, b, keys]
    if softcap:
        cap = np.float32(softcap)
        s /= cap
        np.tanh(s, out=s)
        s *= cap
    # Only two bands of b columns can be masked: the causal triangle at the right end
    # and, with a window, the rows' oldest keys at the left end. Adding -inf (or 0)
    # to those bands gives the same scores as masking the whole matrix, at a tenth
    # of the cost of a boolean mask over every score.
    b = i1 - i0
    rows = np.arange(start + i0, start + i1)[:, None]
    bands = [hi - min(b, hi - lo)]
    if window > 0:
        bands.append(lo)
    for c0 in dict.fromkeys(bands):
        c1 = min(c0 + b, hi)
        cols = np.arange(c0, c1)[None, :]
        masked = cols > rows
        if window > 0:
            masked |= cols <= rows - window
        if masked.any():
            s[:, :, c0 - lo : c1 - lo] += np.where(masked, np.float32(-np.inf), np.float32(0))
    mx = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.asarray(sinks, np.float32)[g * group : (g + 1) * group, None, None]
        mx = np.maximum(mx, sink)  # the sink joins the max, so a dominant sink cannot overflow exp
    s -= mx
    np.exp(s, out=s)
    o = np.matmul(s, vc[g, lo:hi])  # unnormalized: divide the [b, dv] rows, not the scores
    tot = s.sum(axis=-1, keepdims=True)
    if sinks is not None:
        tot += np.exp(sink - mx)
    o /= tot
    out[i0:i1, g * group : (g + 1) * group, :] = o.transpose(1, 0, 2)


def gated_delta_rule(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Gated DeltaNet's recurrence, one position at a time (transformers'
    ``torch_recurrent_gated_delta_rule``); per value head h and position t:

        S = S * exp(g_t);  S += k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S

    q, k [n, hk, dk] (already normalized and scaled); v [n, hv, dv]; g, beta [n, hv];
    state [hv, dk, dv]; each key head serves ``hv / hk`` consecutive value heads.
    Returns (o [n, hv, dv], the new state); ``state`` is not modified.
    """
    n, hk, _ = q.shape
    rep = v.shape[1] // hk
    if rep > 1:
        q = np.repeat(q, rep, axis=1)
        k = np.repeat(k, rep, axis=1)
    S = state.copy()
    decay = np.exp(g).astype(np.float32)
    o = np.empty(v.shape, np.float32)
    for t in range(n):
        S *= decay[t][:, None, None]
        kv_mem = np.matmul(k[t][:, None, :], S)[:, 0, :]  # [hv, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S += k[t][:, :, None] * delta[:, None, :]
        o[t] = np.matmul(q[t][:, None, :], S)[:, 0, :]
    return o, S
